"""rlkernel.integrations.trl against the real TRL: a tiny random Qwen2 GRPOTrainer run (CPU, 3 steps, beta > 0, an
entropy bonus, left-padded prompts and right-padded completions) with and without apply() gives the same per-step
losses (1e-5 relative) and gradients (1e-4 relative norm, float32 weights), with TRL's own head never running
under apply; bf16 autocast runs finish with finite losses; TRL's head, called as its fused forward calls it, equals
TRL's own for every mapped option, and every option rlkernel cannot compute goes back to TRL with its reason.
Skipped without trl; required in `tox -e trl` (tests/integration_support.py)."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "examples"))
from integration_support import framework  # noqa: E402

trl = framework("trl", "trl")

import trl_grpo  # noqa: E402
from trl import kernels as trl_kernels  # noqa: E402
from trl.kernels import chunked_logprob  # noqa: E402
from trl.trainer import utils as trl_utils  # noqa: E402

import rlkernel  # noqa: E402
from rlkernel import dispatch  # noqa: E402
from rlkernel.integrations import UnsupportedVersionError  # noqa: E402
from rlkernel.integrations import trl as rk_trl  # noqa: E402

TRL_HEAD = trl_kernels.ChunkedLogProbFunction
ALL_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


class TrlHeadSpy:
    """Counts the tiles TRL's own head folds (its CPU path, ``_forward_tile``): nonzero only when TRL's kernel ran."""

    def __init__(self, monkeypatch):
        self.calls = 0
        original = chunked_logprob._forward_tile

        def spy(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(chunked_logprob, "_forward_tile", spy)


def counts(rec):
    out = {}
    for r, n in rec.records:
        out[r.op] = out.get(r.op, 0) + n
    return out


def _grpo(tmp_path, *argv):
    args = trl_grpo.build_parser().parse_args(list(argv))
    dtype = trl_grpo.DTYPES[args.dtype]
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    trl_grpo.save_tiny_model(folder, args, dtype)
    return args, dtype, folder


def test_grpo_run_with_apply_matches_trls_own(tmp_path, monkeypatch):
    args, dtype, folder = _grpo(tmp_path)
    assert args.beta > 0 and args.entropy_coef > 0 and args.steps == 3
    spy = TrlHeadSpy(monkeypatch)
    ref = trl_grpo.train(folder, args, torch.device("cpu"), dtype)
    assert spy.calls > 0  # the reference is TRL's own head
    spy.calls = 0
    with rk_trl.apply(), dispatch.recording() as rec:
        got = trl_grpo.train(folder, args, torch.device("cpu"), dtype)
    assert spy.calls == 0  # under apply TRL's head never ran
    # per step: the policy's forward and the reference model's (beta > 0); one backward
    assert counts(rec) == {"linear_logp.forward": 2 * args.steps, "linear_logp.backward": args.steps}
    assert trl_grpo.compare(ref, got, args, dtype) == []
    losses, grads, lengths = got
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    for step in range(3):
        assert trl_grpo.grad_rel(ref[1][step], grads[step]) <= 1e-4
        assert abs(losses[step] - ref[0][step]) <= 1e-5 * abs(ref[0][step])
    # left padding: prompts of 1 to 4 words; right padding: a completion that stopped at EOS before the others
    assert len({len(p.split()) for p in trl_grpo.prompts(args)}) > 1
    assert any(lo < hi for lo, hi in zip(lengths["completions/min_length"], lengths["completions/max_length"],
                                         strict=True))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_bf16_autocast_runs_finish_with_finite_losses(tmp_path, dtype):
    args, torch_dtype, folder = _grpo(tmp_path, "--bf16", "--dtype", dtype)
    with rk_trl.apply(), dispatch.recording() as rec:
        losses, _, _ = trl_grpo.train(folder, args, torch.device("cpu"), torch_dtype)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    if dtype == "bfloat16":  # bf16 weights under bf16 autocast: one dtype, rlkernel's op
        assert counts(rec) == {"linear_logp.forward": 6, "linear_logp.backward": 3}
    else:  # float32 weights under bf16 autocast: mixed precision, TRL's own head, with the reason
        [(r, n)] = rec.records
        assert (r.op, r.status, r.backend, n) == (rk_trl.OP, "fallback", "framework", 6)
        assert r.reason == "mixed dtypes (hidden float32, weight float32, compute bfloat16): the ops take one dtype"


def test_example_exits_0_and_2_on_bad_usage(capsys):
    assert trl_grpo.main(["--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "step 1/1" in out and " ok" in out and "linear_logp.forward" in out
    assert trl_grpo.main(["--generations", "1"]) == 2


def _head_inputs(bias=True, n=37, h=16, v=53, dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(n, h, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g, dtype=dtype) * 0.5).requires_grad_()
    b = (torch.randn(v, generator=g, dtype=dtype) * 0.1).requires_grad_() if bias else None
    return hidden, weight, b, torch.randint(0, v, (n,), generator=g)


def _run_head(head, hidden, weight, bias, targets, temperature=0.7, softcap=None, scale=1.0,
              outputs=("log_probs", "entropy")):
    """TRL's head called as _fused_forward calls it; the values and the gradients of a loss on them."""
    for t in (hidden, weight, bias):
        if t is not None:
            t.grad = None
    out = head.apply(hidden, weight, bias, targets, temperature, 32768, softcap, scale, outputs)
    lp, ent = out[0], out[1]
    (lp.sum() + (0.1 * ent.sum() if ent is not None else 0)).backward()
    grads = [t.grad.clone() for t in (hidden, weight, bias) if t is not None]
    return [x.detach() if x is not None else None for x in out], grads


@pytest.mark.parametrize(("bias", "outputs"), [(True, ("log_probs", "entropy")), (False, ("log_probs",))])
def test_head_equals_trls_with_temperature_bias_and_entropy(bias, outputs):
    inputs = _head_inputs(bias)
    ref, ref_g = _run_head(TRL_HEAD, *inputs, outputs=outputs)
    with rk_trl.apply(), dispatch.recording() as rec:
        got, g = _run_head(trl_utils._ChunkedLogProbFunction, *inputs, outputs=outputs)
    assert counts(rec) == {"linear_logp.forward": 1, "linear_logp.backward": 1}
    assert got[2:] == [None, None, None]
    for a, b in zip(ref[:2], got[:2], strict=True):
        if a is None:
            assert b is None
        else:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    for a, b in zip(ref_g, g, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


FALLBACKS = {
    "softcap": (dict(softcap=30.0), "softcap (final_logit_softcapping=30.0) not supported"),
    "logit_scale": (dict(scale=0.25), "logit_scale=0.25 not supported"),
    "log_sum_sq_probs": (dict(outputs=("log_probs", "entropy", "log_sum_sq_probs")),
                         "outputs log_sum_sq_probs not supported (rlkernel computes log_probs and entropy)"),
    "all_outputs": (dict(outputs=ALL_OUTPUTS), "outputs log_sum_sq_probs, mean_logits, is_top1 not supported "
                                               "(rlkernel computes log_probs and entropy)"),
}


@pytest.mark.parametrize("case", sorted(FALLBACKS))
def test_every_option_rlkernel_cannot_compute_goes_back_to_trl_with_its_reason(case, monkeypatch):
    kwargs, reason = FALLBACKS[case]
    inputs = _head_inputs()
    ref, ref_g = _run_head(TRL_HEAD, *inputs, **kwargs)
    spy = TrlHeadSpy(monkeypatch)
    with rk_trl.apply(), dispatch.recording() as rec, pytest.warns(rlkernel.FallbackWarning, match="framework"):
        got, g = _run_head(trl_utils._ChunkedLogProbFunction, *inputs, **kwargs)
    assert [r for r, _ in rec.records] == [dispatch.Dispatch(rk_trl.OP, "auto", "framework", "fallback", reason)]
    assert spy.calls > 0
    for a, b in zip(ref, got, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    for a, b in zip(ref_g, g, strict=True):
        assert torch.equal(a, b)


def test_zero3_and_mixed_dtype_heads_go_back_to_trl(monkeypatch):
    hidden, weight, bias, targets = _head_inputs()
    zero3 = torch.nn.Parameter(weight.detach().clone())
    zero3.ds_id = 0  # what DeepSpeed ZeRO-3 sets on a partitioned parameter
    with rk_trl.apply(), dispatch.recording() as rec:
        _run_head(trl_utils._ChunkedLogProbFunction, hidden, zero3, bias, targets)
        _run_head(trl_utils._ChunkedLogProbFunction, hidden.detach().bfloat16().requires_grad_(), weight, None,
                  targets)
    reasons = [r.reason for r, _ in rec.records]
    assert reasons == ["the LM head weight is a DeepSpeed ZeRO-3 parameter: sharded weights are not supported",
                       "mixed dtypes (hidden bfloat16, weight float32, compute bfloat16): the ops take one dtype"]


def test_a_fallback_where_fused_is_required_is_blocked(monkeypatch):
    spy = TrlHeadSpy(monkeypatch)
    with rk_trl.apply(require_fused=True), pytest.raises(rlkernel.FusedKernelUnavailable, match="softcap"):
        _run_head(trl_utils._ChunkedLogProbFunction, *_head_inputs(), softcap=30.0)
    assert spy.calls == 0
    assert [r.status for r, _ in dispatch.history()] == ["blocked"]


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_add_fused_lm_head_with_cast_lm_head_to_fp32(model_dtype):
    import transformers as tf

    torch.manual_seed(0)
    model = tf.Qwen2ForCausalLM(tf.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48,
                                               num_hidden_layers=1, num_attention_heads=4,
                                               num_key_value_heads=2)).to(model_dtype).eval()
    trl_utils.add_fused_lm_head(model, temperature=0.8, cast_lm_head_to_fp32=True, outputs=("log_probs", "entropy"))
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    labels = ids.masked_fill(torch.arange(9) < 3, -100)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as GRPOTrainer runs it with bf16=True
        ref = model(ids, labels=labels, fused_lm_head=True)
    with rk_trl.apply(), dispatch.recording() as rec, torch.autocast("cpu", dtype=torch.bfloat16):
        got = model(ids, labels=labels, fused_lm_head=True)
    # float32 weights: TRL disables autocast and computes in float32, the weight's dtype; a bf16 weight (issue 36):
    # TRL's float32 GEMM of the bf16 backbone's output and the bf16 weight, rlkernel's bf16 operands with float32
    # logits (logits_dtype=torch.float32), the same values up to the order of the float32 sums
    assert counts(rec) == {"linear_logp.forward": 1}
    torch.testing.assert_close(got.log_probs, ref.log_probs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.entropy, ref.entropy, rtol=1e-5, atol=1e-5)
    if model_dtype == torch.bfloat16:  # against bf16 logits the error is orders of magnitude larger
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = model.model(ids).last_hidden_state[:, :-1]
        bf16 = torch.log_softmax((h.bfloat16() @ model.lm_head.weight.T).float() / 0.8, -1)
        bf16 = bf16.gather(-1, ids[:, 1:, None].clamp(min=0)).squeeze(-1).masked_fill(labels[:, 1:] < 0, 0)
        assert (bf16 - ref.log_probs).abs().max() > 100 * (got.log_probs - ref.log_probs).abs().max()


def test_apply_is_idempotent_undoes_and_checks_the_version(monkeypatch):
    original = trl_utils._ChunkedLogProbFunction
    p = rk_trl.apply()
    assert rk_trl.apply() is p and isinstance(trl_utils._ChunkedLogProbFunction, rk_trl.RlkernelHead)
    with pytest.raises(ValueError, match="already applied"):
        rk_trl.apply(backend="native")
    p.undo()
    assert trl_utils._ChunkedLogProbFunction is original
    with rk_trl.apply(backend="native") as q:
        assert q is not p and trl_utils._ChunkedLogProbFunction.original is original
    assert trl_utils._ChunkedLogProbFunction is original
    monkeypatch.setattr(sys.modules["trl"], "__version__", "1.15.2")
    with pytest.raises(UnsupportedVersionError, match="supports trl >=1.16,<2.0; found trl 1.15.2"):
        rk_trl.apply()
    monkeypatch.setattr(sys.modules["trl"], "__version__", "1.16.0")
    monkeypatch.delattr(trl_utils, "_ChunkedLogProbFunction")
    with pytest.raises(UnsupportedVersionError, match="has no trl.trainer.utils._ChunkedLogProbFunction"):
        rk_trl.apply()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_head_runs_fused_on_cuda():
    hidden, weight, bias, targets = (t.detach().cuda().requires_grad_() if t.is_floating_point() else t.cuda()
                                     for t in _head_inputs(dtype=torch.bfloat16))
    ref, ref_g = _run_head(TRL_HEAD, hidden, weight, bias, targets)
    with rk_trl.apply(), dispatch.recording() as rec:
        got, g = _run_head(trl_utils._ChunkedLogProbFunction, hidden, weight, bias, targets)
    assert {r.status for r, _ in rec.records} == {"fused"}
    torch.testing.assert_close(got[0], ref[0], rtol=2e-2, atol=2e-2)
