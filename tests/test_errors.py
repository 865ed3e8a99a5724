"""CPU tests of the zero-sync contract's host side (docs/contracts.md, section 1): environment flags, the error
record's ordering and messages, argument checks before any work, and torch.compile of the public ops.

The device-side halves (kernels writing the record, sync-free CUDA calls, CUDA graphs) are in tests/test_zero_sync.py.
"""
from __future__ import annotations

import pathlib
import subprocess
import sys
import warnings

import pytest
import torch

import rlkernel
from rlkernel import dispatch, envflags, errors

# ---- environment flags ----------------------------------------------------------------------------------------

@pytest.mark.smoke
@pytest.mark.parametrize("raw, want", [("1", True), ("true", True), (" Yes ", True), ("ON", True), ("0", False),
                                       ("false", False), ("no", False), ("off", False), ("", None)])
def test_env_bool_accepts_the_usual_spellings(raw, want):
    for default in (False, True):
        expected = default if want is None else want
        assert envflags.env_bool("X", default, {"X": raw}) is expected
    assert envflags.env_bool("X", True, {}) is True  # unset: the default


@pytest.mark.smoke
@pytest.mark.parametrize("raw", ["2", "maybe", "tru", "sync"])
def test_env_bool_rejects_anything_else_naming_the_variable(raw):
    with pytest.raises(envflags.EnvFlagError, match=f"X={raw!r}"):
        envflags.env_bool("X", False, {"X": raw})


@pytest.mark.smoke
def test_validate_mode():
    assert [envflags.validate_mode({"RLKERNEL_VALIDATE": v}) for v in ("", "1", "sync", "SYNC", "0")] == \
        ["1", "1", "sync", "sync", "0"]
    assert envflags.validate_mode({}) == "1"
    with pytest.raises(envflags.EnvFlagError, match="RLKERNEL_VALIDATE='true'"):
        envflags.validate_mode({"RLKERNEL_VALIDATE": "true"})


def test_envflags_cli(monkeypatch, capsys):
    monkeypatch.setenv("CI", "yes")
    assert envflags.main(["CI"]) == 0 and capsys.readouterr().out == "true\n"
    monkeypatch.setenv("CI", "perhaps")
    assert envflags.main(["CI"]) == 2 and "CI='perhaps'" in capsys.readouterr().err
    monkeypatch.delenv("CI")
    assert envflags.main(["CI", "true"]) == 0 and capsys.readouterr().out == "true\n"


@pytest.mark.parametrize("raw, strict", [("false", False), ("0", False), ("off", False), ("", False),
                                         ("true", True), ("1", True), ("yes", True)])
def test_require_fused_from_env_is_a_boolean(monkeypatch, raw, strict):  # issue 19 item 18
    monkeypatch.setenv("RLKERNEL_REQUIRE_FUSED", raw)
    x, ids = torch.randn(2, 7), torch.tensor([1, 2])
    if strict:
        with pytest.raises(rlkernel.FusedKernelUnavailable):
            rlkernel.logp(x, ids)
    else:
        assert rlkernel.logp(x, ids).shape == (2,)


def test_require_fused_with_a_bad_value_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("RLKERNEL_REQUIRE_FUSED", "sometimes")
    with pytest.raises(envflags.EnvFlagError, match="RLKERNEL_REQUIRE_FUSED"):
        rlkernel.logp(torch.randn(2, 7), torch.tensor([1, 2]))


# ---- the record ------------------------------------------------------------------------------------------------

def fresh():
    return torch.tensor([errors.EMPTY, 0, 0, 0])


def test_record_keeps_the_first_position_of_the_earliest_call():
    rec = fresh()
    errors.note(rec, errors.ERR_LOGP_BAD_ID, 7, torch.tensor([False, False, True, True]), torch.tensor([0, 0, 9, 8]))
    assert rec.tolist()[:3] == [(7 << 32) | 2, errors.ERR_LOGP_BAD_ID, 9]
    errors.note(rec, errors.ERR_SAMPLE_NO_DIST, 9, torch.tensor([True]), None)  # a later call: not kept
    assert rec.tolist()[:3] == [(7 << 32) | 2, errors.ERR_LOGP_BAD_ID, 9]
    errors.note(rec, errors.ERR_SAMPLE_NO_DIST, 5, torch.tensor([False, True]), None)  # an earlier call: kept
    assert rec.tolist()[:3] == [(5 << 32) | 1, errors.ERR_SAMPLE_NO_DIST, -1]
    errors.note(rec, errors.ERR_LOGP_BAD_ID, 5, torch.tensor([[False], [False]]), torch.tensor([[1], [2]]))
    assert rec.tolist()[:3] == [(5 << 32) | 1, errors.ERR_SAMPLE_NO_DIST, -1]  # nothing bad: unchanged


def test_a_record_made_in_inference_mode_is_written_and_cleared_outside_it():
    with torch.inference_mode():
        rec = errors._fresh_record(torch.device("cpu"))
        errors.note(rec, errors.ERR_LOGP_BAD_ID, 3, torch.tensor([False, True]), torch.tensor([0, 9]))
    errors.note(rec, errors.ERR_LOGP_BAD_ID, 2, torch.tensor([True]), torch.tensor([8]))
    assert rec.tolist() == [2 << 32, errors.ERR_LOGP_BAD_ID, 8, 0]
    errors._clear(rec, (5 << 32))  # not the key it holds: kept
    assert rec[0].item() == 2 << 32
    errors._clear(rec, 2 << 32)
    assert rec[0].item() == errors.EMPTY and rec[3].item() == 0  # the lock word untouched


def test_errors_are_named_from_the_ring(monkeypatch):
    monkeypatch.setattr(errors, "_ring", [None] * errors.RING)
    errors._ring[12 % errors.RING] = (12, "logp.forward", (2, 3), 50)
    e = errors.describe((12 << 32) | 4, errors.ERR_LOGP_BAD_ID, 77)
    assert isinstance(e, IndexError)
    assert str(e) == "logp.forward: token id out of range at position (1, 1) (id 77, vocab size 50) [call #12]"
    errors._ring[13 % errors.RING] = (13, "sample", (4,), 50)
    e = errors.describe((13 << 32) | 2, errors.ERR_SAMPLE_NO_DIST, -1)
    assert isinstance(e, ValueError) and str(e).startswith("sample: row 2 has no finite probabilities")
    # a call the ring no longer holds, and a compiled call, are still named by op and flat position
    e = errors.describe(((12 + errors.RING) << 32) | 4, errors.ERR_LOGP_BAD_ID, 77)
    assert "no longer remembered" in str(e) and "position 4 " in str(e)
    assert "torch.compile" in str(errors.describe(4, errors.ERR_LOGP_BAD_ID, 77))


def test_the_trace_time_mark_is_torchs_own():
    from rlkernel.traced import constant_when_traced

    def a():
        return 1

    def b():
        return 1

    torch.compiler.assume_constant_result(a)
    constant_when_traced(b)
    assert vars(a) == vars(b) == {"_dynamo_marked_constant": True}


def test_importing_the_ops_does_not_import_dynamo():
    code = "import sys, rlkernel.ops.logp, rlkernel.ops.sampling; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=pathlib.Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_check_errors_is_a_no_op_on_cpu():
    errors.check_errors("cpu")
    errors.check_errors(torch.device("cpu"))


# ---- argument checks: before any work, no dispatch record (issue 19 items 15-17, 19) ---------------------------

@pytest.mark.parametrize("call, exc, words", [
    (lambda: rlkernel.logp(torch.randn(2, 5), torch.tensor([0, 1]), ignore_index=2 ** 70), ValueError,
     "ignore_index"),
    (lambda: rlkernel.logp(torch.randn(2, 5), torch.tensor([0, 1]), ignore_index=1.5), TypeError, "ignore_index"),
    (lambda: rlkernel.sample(torch.randn(2, 5), top_k=float("inf")), ValueError, "top_k"),
    (lambda: rlkernel.sample(torch.randn(2, 5), top_k=2.5), ValueError, "top_k"),
    (lambda: rlkernel.sample(torch.randn(2, 5), generator="abc"), TypeError, "generator"),
    (lambda: rlkernel.sample(torch.randn(2, 5), top_p="x"), TypeError, "top_p"),
    (lambda: rlkernel.logp(torch.randn(2, 5, device="meta"), torch.zeros(2, dtype=torch.long, device="meta")),
     ValueError, "meta"),
    (lambda: rlkernel.sample(torch.randn(2, 5, device="meta")), ValueError, "meta"),
    (lambda: rlkernel.logp(torch.randn(2, 5), torch.tensor([0, 1]), temperature=1e-45), ValueError, "temperature"),
    (lambda: rlkernel.sample(torch.randn(2, 5), temperature=1e-45), ValueError, "temperature"),
    (lambda: rlkernel.logp(torch.randn(2, 5), torch.tensor([0, 1]), temperature="1"), TypeError, "temperature"),
    (lambda: rlkernel.logp(torch.randn(2, 5), torch.tensor([0, 5])), IndexError, r"position \(1,\)"),
])
def test_bad_arguments_raise_naming_them_and_leave_no_record(call, exc, words):
    dispatch.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no FallbackWarning either
        with pytest.raises(exc, match=words):
            call()
    assert dispatch.history() == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tiny_temperatures_that_fit_float32_are_finite(dtype):
    x = torch.randn(3, 11, dtype=dtype)
    lp = rlkernel.logp(x, torch.tensor([0, 1, 2]), temperature=1e-30)  # log2(e)/T fits float32
    assert torch.isfinite(lp).all()
    assert torch.equal(rlkernel.sample(x, temperature=1e-30), x.argmax(-1))


def test_empty_vocabulary_with_every_id_ignored_gives_zeros():  # issue 19 item 15
    x = torch.randn(3, 0, requires_grad=True)
    ids = torch.full((3,), -100)
    lp, ent = rlkernel.logp(x, ids, return_entropy=True)
    assert lp.tolist() == [0.0, 0.0, 0.0] and ent.tolist() == [0.0, 0.0, 0.0]
    (lp.sum() + ent.sum()).backward()
    assert x.grad.shape == (3, 0)
    with pytest.raises(IndexError):
        rlkernel.logp(torch.randn(3, 0), torch.tensor([-100, 0, -100]))


@pytest.mark.parametrize("shape", [(0, 0), (0, 5), (2, 0, 7)])
def test_sample_empty_in_empty_out(shape):  # issue 19 item 15
    x = torch.randn(*shape)
    ids, lp = rlkernel.sample(x, top_k=3, return_logprobs=True)
    assert ids.shape == shape[:-1] and lp.shape == shape[:-1] and ids.dtype == torch.int64


def test_top_k_beyond_the_vocabulary_keeps_every_token():
    x = torch.randn(4, 9)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(rlkernel.sample(x, top_k=2 ** 70, generator=g1), rlkernel.sample(x, top_k=0, generator=g2))


def test_cpu_rows_without_a_distribution_raise_at_once():
    x = torch.randn(3, 20)
    x[1] = float("-inf")
    with pytest.raises(ValueError, match="row 1"):
        rlkernel.sample(x)
    with pytest.raises(ValueError, match="row 1"):
        rlkernel.sample(x, temperature=0)


# ---- torch.compile (the native path here; the fused one in tests/test_zero_sync.py) ----------------------------

def _logp_step(x, ids):
    lp, ent = rlkernel.logp(x, ids, return_entropy=True, temperature=0.7)
    return lp, ent


def test_compiled_logp_has_no_graph_break_and_equals_eager():
    torch._dynamo.reset()
    x = torch.randn(4, 6, 33, requires_grad=True)
    ids = torch.randint(0, 33, (4, 6))
    explain = torch._dynamo.explain(_logp_step)(x, ids)
    assert explain.graph_break_count == 0, explain.break_reasons
    compiled = torch.compile(_logp_step, backend="aot_eager", fullgraph=True)
    dispatch.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):  # counting the records must not recompile
        for _ in range(12):
            lp_c, ent_c = compiled(x, ids)  # the cached graph records each call
    (lp_c.sum() + ent_c.sum()).backward()
    grad_c, x.grad = x.grad.clone(), None
    recs = {(r.op, r.status): n for r, n in dispatch.history()}
    # one record per call, the trace's decision; the backward's counted with its forward call
    assert recs == {("logp.forward", "fallback"): 12, ("logp.backward", "fallback"): 12}
    lp, ent = _logp_step(x, ids)
    (lp.sum() + ent.sum()).backward()
    assert torch.equal(lp_c, lp) and torch.equal(ent_c, ent) and torch.equal(grad_c, x.grad)


def test_compiled_sample_has_no_graph_break_and_equals_eager():
    torch._dynamo.reset()

    def draw(x):
        return rlkernel.sample(x, top_k=5, top_p=0.9, temperature=0.8, return_logprobs=True)

    x = torch.randn(8, 40)
    explain = torch._dynamo.explain(draw)(x)
    assert explain.graph_break_count == 0, explain.break_reasons
    compiled = torch.compile(draw, backend="aot_eager", fullgraph=True)
    torch.manual_seed(11)
    ids_c, lp_c = compiled(x)
    torch.manual_seed(11)
    ids, lp = draw(x)
    assert torch.equal(ids_c, ids) and torch.equal(lp_c, lp)
