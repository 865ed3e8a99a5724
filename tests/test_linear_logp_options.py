"""The options of rlkernel.linear_logp / linear_logp_loss (issue 31, items 2-5) on the native backend (CPU): per-row
temperature, softcap and logit_scale, entropy without ids, the extra outputs; float64 references for every option
and their combinations, gradcheck, argument checks, and TRL 1.16's ChunkedLogProbFunction where trl imports.

Tolerances: float64 inputs, so the op computes in float64 and rounds once to float32 on the way out: atol 2e-6 +
rtol 1e-6 (a float32 rounding of values up to ~10). Gradients by gradcheck (float64, its own tolerances). TRL
(float32 inputs, float32 everywhere, its chunked online logsumexp vs our log_softmax): 1e-5 on values of size ~5
and gradients of size ~1, a few float32 roundings of each.
"""
from __future__ import annotations

import itertools
import math
import re

import pytest
import torch
from integration_support import required

import rlkernel
from rlkernel import dispatch
from rlkernel.ops.linear_options import OUTPUT_NAMES, LinearLogpOutput
from rlkernel.ops.native import linear_logp as native_mod

IGNORE = -100
EXTRAS = ("log_sum_sq_probs", "mean_logit", "is_top1")


def make(lead, h, v, dtype=torch.float64, *, bias=True, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*lead, h, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64) * scale / math.sqrt(h)).to(dtype)
    b = (torch.randn(v, generator=g, dtype=torch.float64) * 0.5).to(dtype) if bias else None
    ids = torch.randint(0, v, tuple(lead), generator=g)
    if ids.numel() > 2:
        ids.view(-1)[1] = IGNORE
    # a row whose id is its argmax: is_top1 True somewhere
    x = hidden.double() @ weight.double().t() + (b.double() if b is not None else 0)
    ids.view(-1)[0] = int(x.reshape(-1, v)[0].argmax())
    return hidden, weight, b, ids


def reference(hidden, weight, bias, ids, temperature=1.0, scale=1.0, softcap=None):
    """float64 (logp, entropy, log sum p^2, mean z', is_top1), ignored rows 0 / False, by the definitions."""
    z = hidden.double() @ weight.double().t()
    if bias is not None:
        z = z + bias.double()
    z = z * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    t = temperature.double().expand(hidden.shape[:-1]).unsqueeze(-1) if isinstance(temperature, torch.Tensor) \
        else temperature
    z = z / t
    lp_all = torch.log_softmax(z, -1)
    p = lp_all.exp()
    valid = ids != IGNORE if ids is not None else torch.ones(hidden.shape[:-1], dtype=torch.bool)
    safe = torch.where(valid, ids, 0) if ids is not None else torch.zeros(hidden.shape[:-1], dtype=torch.long)
    zero = torch.zeros((), dtype=torch.float64)
    logp = torch.where(valid, lp_all.gather(-1, safe.unsqueeze(-1)).squeeze(-1), zero)
    ent = torch.where(valid, -(p * lp_all).sum(-1), zero)
    lssp = torch.where(valid, (p * p).sum(-1).log(), zero)
    mean = torch.where(valid, z.mean(-1), zero)
    top1 = valid & (z.argmax(-1) == safe)
    return logp, ent, lssp, mean, top1


def per_row_t(lead, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(*lead, generator=g, dtype=torch.float64) * 1.5 + 0.3


TEMPERATURES = ("scalar", "per-row", "0-dim")


def _temperature(kind, lead):
    return {"scalar": 0.7, "per-row": per_row_t(lead), "0-dim": torch.tensor(1.3)}[kind]


def _close(got, want, name):
    if want.dtype == torch.bool:
        assert torch.equal(got, want), name
    else:
        assert got.dtype == torch.float32, name
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-6, msg=name)


@pytest.mark.parametrize("t_kind,softcap,scale,bias,batch_invariant", [
    (t, c, s, b, bi) for t, c, s in itertools.product(TEMPERATURES, (None, 2.5), (1.0, 0.6))
    for b, bi in ((True, False), (False, True))])
def test_every_option_and_combination_matches_float64(monkeypatch, t_kind, softcap, scale, bias, batch_invariant):
    monkeypatch.setattr(native_mod, "_CHUNK_BYTES", 8 * 3 * 37)  # several token chunks
    monkeypatch.setattr(native_mod, "BI_ROWS", 4)
    lead = (2, 5)
    hidden, weight, b, ids = make(lead, 12, 37, bias=bias)
    t = _temperature(t_kind, lead)
    got = rlkernel.linear_logp(hidden, weight, ids, bias=b, temperature=t, softcap=softcap, logit_scale=scale,
                               outputs=OUTPUT_NAMES, batch_invariant=batch_invariant, backend="native")
    assert isinstance(got, LinearLogpOutput)
    want = reference(hidden, weight, b, ids, t, scale, softcap)
    for name, g, w in zip(LinearLogpOutput._fields, got, want, strict=True):
        _close(g, w, name)
    assert bool(got.is_top1.view(-1)[0])  # row 0's id is its argmax (make), whatever the transform
    # each output alone: the same values (the fields not asked are None)
    for name in OUTPUT_NAMES:
        one = rlkernel.linear_logp(hidden, weight, ids, bias=b, temperature=t, softcap=softcap, logit_scale=scale,
                                   outputs=(name,), batch_invariant=batch_invariant, backend="native")
        assert all((v is None) == (f not in ("logp", name)) for f, v in zip(one._fields, one, strict=True))
        assert torch.equal(getattr(one, name), getattr(got, name)), name


@pytest.mark.parametrize("t_kind,softcap,scale", [("per-row", None, 1.0), ("scalar", 1.5, 1.0), ("scalar", None, 1.7),
                                                  ("per-row", 1.5, 1.7), ("0-dim", 1.5, 1.7)])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_gradcheck_float64(monkeypatch, t_kind, softcap, scale, batch_invariant):
    """Each option alone and all together (the plain call: tests/test_linear_logp_native.py)."""
    monkeypatch.setattr(native_mod, "_CHUNK_BYTES", 8 * 2 * 23)  # 2 rows per chunk
    monkeypatch.setattr(native_mod, "BI_ROWS", 4)
    lead = (5,)
    hidden, weight, b, ids = make(lead, 6, 23, seed=2, scale=2.0)
    t = _temperature(t_kind, lead)
    leaves = [a.requires_grad_(True) for a in (hidden, weight, b)]
    opts = rlkernel.ops.linear_options.check_options(hidden, t, softcap, scale, OUTPUT_NAMES, True, "test")[0]

    def f(h, w, bias):
        res = native_mod.linear_logp_native(h, w, ids, bias=bias, temperature=1.0, ignore_index=IGNORE,
                                            return_entropy=True, batch_invariant=batch_invariant, keep_dtype=True,
                                            opts=opts)
        return res[0], res[1]  # logp and entropy: the differentiable outputs

    assert torch.autograd.gradcheck(f, leaves)


def test_gradients_against_float64_autograd_through_the_public_op():
    """softcap + scale + per-row T, loss on logp and entropy: the op's gradients = autograd of the reference."""
    lead = (3, 4)
    hidden, weight, b, ids = make(lead, 10, 29, seed=4)
    t = per_row_t(lead, seed=5)
    leaves = [a.clone().requires_grad_(True) for a in (hidden, weight, b)]
    refs = [a.clone().requires_grad_(True) for a in (hidden, weight, b)]
    g = torch.Generator().manual_seed(6)
    gl, ge = torch.randn(lead, generator=g), torch.randn(lead, generator=g)
    out = rlkernel.linear_logp(*leaves[:2], ids, bias=leaves[2], temperature=t, softcap=2.0, logit_scale=0.8,
                               outputs=("entropy",), backend="native")
    torch.autograd.backward([out.logp, out.entropy], [gl, ge])
    lp, ent, *_ = reference(*refs[:2], refs[2], ids, t, 0.8, 2.0)
    torch.autograd.backward([lp, ent], [gl.double(), ge.double()])
    for got, want, name in zip(leaves, refs, ("hidden", "weight", "bias"), strict=True):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-10, rtol=1e-9, msg=name)
    assert torch.all(leaves[0].grad[ids == IGNORE] == 0)


def test_extras_have_no_gradient_and_entropy_keeps_its_own():
    hidden, weight, b, ids = make((6,), 8, 19)
    hidden.requires_grad_(True)
    out = rlkernel.linear_logp(hidden, weight, ids, bias=b, outputs=OUTPUT_NAMES, softcap=3.0, backend="native")
    assert out.logp.requires_grad and out.entropy.requires_grad
    assert not any(getattr(out, n).requires_grad for n in EXTRAS)
    out.entropy.sum().backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0


def test_entropy_without_ids_is_the_entropy_of_every_row():
    lead = (2, 3)
    hidden, weight, b, ids = make(lead, 8, 21)
    t = per_row_t(lead)
    ent = rlkernel.linear_logp(hidden, weight, None, bias=b, temperature=t, return_entropy=True, backend="native")
    assert isinstance(ent, torch.Tensor) and ent.shape == lead
    want = reference(hidden, weight, b, None, t)[1]
    _close(ent, want, "entropy")
    # with ids the same rows (ignored ones aside) have the same entropy
    _, with_ids = rlkernel.linear_logp(hidden, weight, ids, bias=b, temperature=t, return_entropy=True,
                                       backend="native")
    keep = ids != IGNORE
    assert torch.equal(ent[keep], with_ids[keep]) and ent[~keep].abs().min() > 0
    # the entropy's gradient flows without ids
    h = hidden.clone().requires_grad_(True)
    rlkernel.linear_logp(h, weight, None, bias=b, return_entropy=True, backend="native").sum().backward()
    assert h.grad.abs().sum() > 0
    # outputs without ids: logp None, the statistics of every row
    out = rlkernel.linear_logp(hidden, weight, None, bias=b, outputs=("log_sum_sq_probs", "mean_logit"),
                               backend="native")
    assert out.logp is None and out.entropy is None and out.is_top1 is None
    _close(out.mean_logit, reference(hidden, weight, b, None)[3], "mean_logit")


def test_return_entropy_keeps_todays_results():
    hidden, weight, b, ids = make((7,), 8, 25)
    lp, ent = rlkernel.linear_logp(hidden, weight, ids, bias=b, temperature=0.9, return_entropy=True,
                                   backend="native")
    out = rlkernel.linear_logp(hidden, weight, ids, bias=b, temperature=0.9, outputs=("entropy",), backend="native")
    assert torch.equal(out.logp, lp) and torch.equal(out.entropy, ent)
    # identity options (logit_scale 1, a 0-dim T equal to the number) give today's values
    same = rlkernel.linear_logp(hidden, weight, ids, bias=b, temperature=torch.tensor(0.9, dtype=torch.float64),
                                logit_scale=1, backend="native")
    torch.testing.assert_close(same, lp, atol=0, rtol=1e-7)


def test_bad_per_row_temperature_on_cpu_raises_naming_the_row():
    lead = (2, 3)
    hidden, weight, b, ids = make(lead, 8, 11)
    for value in (0.0, -1.0, math.nan, math.inf, 1e-45):
        t = torch.ones(lead, dtype=torch.float64)
        t[1, 0] = value
        with dispatch.recording() as rec:
            with pytest.raises(ValueError, match=r"linear_logp.forward: temperature of row 3 is out of range.*> 0"):
                rlkernel.linear_logp(hidden, weight, ids, temperature=t)
            with pytest.raises(ValueError, match=r"linear_logp_loss: temperature of row 3"):
                rlkernel.linear_logp_loss(hidden, weight, ids, lambda lp, en, sl: -lp, temperature=t)
        assert rec.records == []  # refused before any dispatch


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(softcap=0.0), ValueError, "softcap must be a finite number > 0"),
    (dict(softcap=-2.0), ValueError, "softcap"),
    (dict(softcap=math.inf), ValueError, "softcap"),
    (dict(softcap="30"), TypeError, "softcap must be a real number"),
    (dict(softcap=True), TypeError, "softcap"),
    (dict(logit_scale=0.0), ValueError, "logit_scale must be a finite number > 0"),
    (dict(logit_scale=math.nan), ValueError, "logit_scale"),
    (dict(logit_scale=None), TypeError, "logit_scale must be a real number"),
    (dict(outputs="entropy"), TypeError, r"pass \('entropy',\)"),
    (dict(outputs=("entropy", "mean_logits")), ValueError, "TRL calls it mean_logits"),
    (dict(outputs=("perplexity",)), ValueError, "unknown output 'perplexity'"),
    (dict(outputs=(1,)), TypeError, "names"),
    (dict(outputs=3), TypeError, "tuple of names"),
    (dict(temperature=torch.ones(3)), ValueError, r"temperature must be a number, a 0-dim tensor or a tensor of "
                                                  r"shape \(2, 3\)"),
    (dict(temperature=torch.ones(2, 3, dtype=torch.bool)), TypeError, "temperature must be a real tensor"),
    (dict(token_ids=None), ValueError, "token_ids=None gives no log-probs"),
    (dict(token_ids=None, outputs=("is_top1",)), ValueError, "is_top1 .* needs token_ids"),
])
def test_argument_checks(kwargs, error, match):
    hidden, weight, b, ids = make((2, 3), 8, 11)
    call = dict(token_ids=ids) | kwargs
    with dispatch.recording() as rec:
        with pytest.raises(error, match=match):
            rlkernel.linear_logp(hidden, weight, call.pop("token_ids"), **call)
    assert rec.records == []


def test_loss_rejects_missing_ids_and_bad_transforms():
    hidden, weight, b, ids = make((4,), 8, 11)
    with pytest.raises(TypeError, match="linear_logp_loss needs the ids"):
        rlkernel.linear_logp_loss(hidden, weight, None, lambda lp, en, sl: -lp)
    with pytest.raises(ValueError, match="softcap"):
        rlkernel.linear_logp_loss(hidden, weight, ids, lambda lp, en, sl: -lp, softcap=-1.0)


@pytest.mark.parametrize("t_kind,softcap,scale", [("per-row", None, 1.0), ("scalar", 2.0, 0.7),
                                                  ("per-row", 2.0, 0.7), ("0-dim", None, 1.4)])
def test_loss_matches_float64_with_the_same_options(t_kind, softcap, scale):
    """linear_logp_loss (its gradients computed in the forward, float64 inputs: float64 throughout) = autograd of
    the float64 reference, values and gradients."""
    lead = (3, 5)
    hidden, weight, b, ids = make(lead, 8, 31, seed=7)
    t = _temperature(t_kind, lead)
    adv = torch.randn(lead, dtype=torch.float64).reshape(-1)

    def leaves():
        return [a.clone().requires_grad_(True) for a in (hidden, weight, b)]

    a = leaves()
    loss = rlkernel.linear_logp_loss(a[0], a[1], ids, lambda lp, en, sl: -lp * adv[sl] + 0.1 * en, bias=a[2],
                                     chunk_size=4, backend="native", temperature=t, softcap=softcap,
                                     logit_scale=scale)
    loss.backward()
    r = leaves()
    lp, en = reference(r[0], r[1], r[2], ids, t, scale, softcap)[:2]
    keep = (ids != IGNORE).reshape(-1)
    want = torch.where(keep, -lp.reshape(-1) * adv + 0.1 * en.reshape(-1), 0.0).sum()
    want.backward()
    torch.testing.assert_close(loss, want, atol=1e-12, rtol=1e-10)
    for x, y, name in zip(a, r, ("hidden", "weight", "bias"), strict=True):
        torch.testing.assert_close(x.grad, y.grad, atol=1e-12, rtol=1e-9, msg=name)


def test_dispatch_on_cpu_is_the_usual_fallback():
    hidden, weight, b, ids = make((4,), 8, 11)
    with dispatch.recording() as rec:
        rlkernel.linear_logp(hidden.float(), weight.float(), ids, softcap=5.0, outputs=EXTRAS)
    (r, count), = rec.records
    assert (r.op, r.backend, r.status, r.reason, count) == ("linear_logp.forward", "native", "fallback",
                                                            "tensor on cpu", 1)


# ---- TRL 1.16's fused head, where it imports (the tox env `trl` has it) ----

def _trl():
    """trl.kernels.chunked_logprob: skipped where trl is absent, a failure in the tox env `trl`
    (RLKERNEL_REQUIRE_INTEGRATIONS=trl, tests/integration_support.py)."""
    if required("trl"):
        import trl.kernels.chunked_logprob as mod
    else:
        mod = pytest.importorskip("trl.kernels.chunked_logprob", reason="trl (1.16) not installed")
    if not hasattr(mod, "ChunkedLogProbFunction") and not required("trl"):
        pytest.skip("this trl has no ChunkedLogProbFunction")
    return mod


@pytest.mark.parametrize("softcap,scale,temperature", [(None, 1.0, 1.0), (30.0, 1.0, 0.8), (2.0, 0.5, 1.3),
                                                       (None, 0.0625, 0.7)])
def test_matches_trl_chunked_logprob(softcap, scale, temperature):
    trl = _trl()
    torch.manual_seed(0)
    n, h, v = 24, 16, 300
    hidden = torch.randn(n, h)
    weight = torch.randn(v, h) * 4.0 / math.sqrt(h)
    bias = torch.randn(v) * 0.5
    ids = torch.randint(0, v, (n,))
    ids[0] = int((hidden[0] @ weight.t() + bias).argmax())
    g = torch.randn(n), torch.randn(n)

    def run_trl():
        leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
        outs = trl.ChunkedLogProbFunction.apply(*leaves, ids, temperature, 128, softcap, scale,
                                                ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1"))
        torch.autograd.backward([outs[0], outs[1]], list(g))
        return outs, [t.grad for t in leaves]

    def run_ours():
        leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
        out = rlkernel.linear_logp(leaves[0], leaves[1], ids, bias=leaves[2], temperature=temperature,
                                   softcap=softcap, logit_scale=scale, outputs=OUTPUT_NAMES, backend="native")
        torch.autograd.backward([out.logp, out.entropy], list(g))
        return out, [t.grad for t in leaves]

    (t_lp, t_ent, t_sq, t_mean, t_top), t_grads = run_trl()
    ours, grads = run_ours()
    for name, a, b in (("logp", ours.logp, t_lp), ("entropy", ours.entropy, t_ent),
                       ("log_sum_sq_probs", ours.log_sum_sq_probs, t_sq), ("mean_logit", ours.mean_logit, t_mean)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    assert torch.equal(ours.is_top1, t_top) and bool(t_top[0])
    for name, a, b in zip(("hidden", "weight", "bias"), grads, t_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)


def test_which_options_the_fused_kernels_have():
    """Options.fused_gap: linear_logp's and linear_logp_loss's fused kernels have every option, the three statistics
    included (float32 inputs here: no float32-output GEMM question, so no CUDA is needed); a temperature whose scale
    overflows float32, or falls below its smallest normal number, is what is left."""
    from rlkernel.ops.linear_options import Options

    cuda, f32 = torch.device("cuda"), torch.float32
    rows = torch.ones(4)
    assert Options(0.7, 0.5).fused_gap(cuda, f32) is None
    assert Options(rows, 1.0, 30.0).fused_gap(cuda, f32) is None
    assert Options(1.0, has_ids=False).fused_gap(cuda, f32) is None
    assert Options(extras=("mean_logit", "is_top1")).fused_gap(cuda, f32) is None
    assert Options(rows, 0.5, 30.0, ("log_sum_sq_probs", "mean_logit", "is_top1")).fused_gap(cuda, f32) is None
    assert Options(0.7, 0.5).fused_gap(cuda, f32, loss=True) is None
    assert Options(rows).fused_gap(cuda, f32, loss=True) is None
    assert Options(1.0, 1.0, 30.0).fused_gap(cuda, f32, loss=True) is None
    assert Options(rows, 0.5, 30.0).fused_gap(cuda, f32, loss=True) is None
    outside = "outside float32's normal range"
    assert outside in Options(1e-30, 1e10).fused_gap(cuda, f32, loss=True)
    assert outside in Options(1e-30, 1e10).fused_gap(cuda, f32)  # log2(e) * scale / T = 1.4e40 > float32 max
    assert outside in Options(1.0, 1e-39).fused_gap(cuda, f32)  # 1.4e-39: below float32's smallest normal number


def test_fallback_for_records_the_missing_option_and_blocks_a_demanded_fused_path(monkeypatch):
    """The dispatch decision of a CUDA call whose fused path lacks its option (the fused path's availability faked
    available: the one edge a CPU test cannot reach)."""
    from rlkernel.ops.linear_options import Options, fallback_for

    monkeypatch.setattr(dispatch, "fused_unavailable_reason", lambda op, device, dtype: None)
    cuda, f32 = torch.device("cuda"), torch.float32
    opts, op = Options(1e-30, 1e10), "linear_logp_loss"  # log2(e) * scale / T overflows the kernels' float32
    reason = "temperature / logit_scale: its log2(e) scale is outside float32's normal range in the fused kernels"
    with dispatch.recording() as rec:
        r = fallback_for(op, opts, "auto", False, cuda, f32, loss=True)
        assert (r.backend, r.status, r.reason) == ("native", "fallback", reason)
        with pytest.raises(dispatch.FusedKernelUnavailable, match=re.escape(reason)):
            fallback_for(op, opts, "fused", False, cuda, f32, loss=True)
        with pytest.raises(dispatch.FusedKernelUnavailable):
            fallback_for(op, opts, "auto", True, cuda, f32, loss=True)
        assert fallback_for(op, opts, "native", False, cuda, f32, loss=True) is None
        assert fallback_for(op, Options(0.5, 2.0), "fused", False, cuda, f32, loss=True) is None
        assert fallback_for(op, Options(torch.ones(4), 1.0, 30.0), "fused", False, cuda, f32, loss=True) is None
        assert fallback_for(op, opts, "auto", False, torch.device("cpu"), f32, loss=True) is None
        # linear_logp's fused kernels have the statistics now: nothing to record
        assert fallback_for("linear_logp.forward", Options(extras=("is_top1",)), "fused", False, cuda, f32) is None
    assert sorted(d.status for d, _ in rec.records) == ["blocked", "blocked", "fallback"]
