"""GPU tests of rlkernel.linear_logp's options (issue 31, items 2-5) on CUDA (skipped without it; a CUDA machine
without the build fails): the fused option kernels (per-row temperature, softcap, logit_scale, entropy without ids)
against float64 and the native path, the extra outputs' fused dispatch, CUDA graphs, and the device error record
for bad per-row temperatures (no host sync).

Tolerances (vs float64 of the exact product of the same inputs): each logit carries at most one unit roundoff u |x|
of the inputs' dtype (u = 2^-8 bf16; float32: TF32 off, ~1e-6 relative), so z' = transform(x) / T moves by at most
u max|x| / T per row (scale and the softcap's tanh are 1-Lipschitz in units of scale), logp and entropy by twice
that, plus 3e-5 for the float32 kernels. Softcapped calls keep float32 logits (no 16-bit rounding at all). Gradients
(float32 inputs): 1e-4 of the largest element plus 1e-5 (float32 tiles and GEMMs, products of <= 256 terms).
"""
from __future__ import annotations

import contextlib
import math

import pytest
import torch
from cuda_graphs import warm_on_side_stream

import rlkernel
from rlkernel import dispatch
from rlkernel.ops.linear_options import OUTPUT_NAMES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

IGNORE = -100
UNIT = {torch.float32: 2.0 ** -20, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


@pytest.fixture(scope="module")
def fused(fused_linear):
    return fused_linear  # tests/conftest.py: fails where CUDA is but the extension is not


def make(n, h, v, dtype, *, bias=True, seed=0, scale=3.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, h, device="cuda", generator=g).to(dtype)
    weight = (torch.randn(v, h, device="cuda", generator=g) * scale / math.sqrt(h)).to(dtype)
    b = (torch.randn(v, device="cuda", generator=g) * 0.5).to(dtype) if bias else None
    ids = torch.randint(0, v, (n,), device="cuda", generator=g)
    if n > 2:
        ids[1] = IGNORE
    t = torch.rand(n, device="cuda", generator=g) * 1.5 + 0.4
    return hidden, weight, b, ids, t


def reference(hidden, weight, bias, ids, temperature=1.0, scale=1.0, softcap=None):
    """float64 (logp, entropy, max |x| per row) of the exact product; ids None: every row."""
    x = hidden.double() @ weight.double().t()
    if bias is not None:
        x = x + bias.double()
    z = x * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    t = temperature.double()[:, None] if isinstance(temperature, torch.Tensor) else temperature
    z = z / t
    lp_all = torch.log_softmax(z, -1)
    p = lp_all.exp()
    valid = ids != IGNORE if ids is not None else torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    safe = torch.where(valid, ids, 0) if ids is not None else torch.zeros_like(valid, dtype=torch.long)
    lp = torch.where(valid, lp_all.gather(-1, safe[:, None])[:, 0], 0.0)
    ent = torch.where(valid, -torch.where(p > 0, p * lp_all, 0.0).sum(-1), 0.0)
    size = (x.abs().amax(-1) * scale) / (t[:, 0] if isinstance(temperature, torch.Tensor) else t)
    return lp, ent, size


def tolerance(dtype, size, softcap):
    u = UNIT[torch.float32] if softcap is not None else UNIT[dtype]  # softcapped: float32 logits
    return 2 * u * size + 3e-5


OPTIONS = [  # (per-row temperature, softcap, logit_scale)
    (True, None, 1.0), (False, 30.0, 1.0), (False, None, 0.0625), (True, 5.0, 0.5), (False, 5.0, 1.0)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("per_row,softcap,scale", OPTIONS)
@pytest.mark.parametrize("chunk,batch_invariant", [(None, False), ((48, 512), False), (None, True)])
def test_fused_options_match_float64(fused, dtype, per_row, softcap, scale, chunk, batch_invariant):
    hidden, weight, b, ids, t_rows = make(130, 64, 3001, dtype, seed=1)
    t = t_rows if per_row else 0.8
    ctx = fused.chunking(*chunk) if chunk else contextlib.nullcontext()
    with ctx, dispatch.recording() as rec:
        lp, ent = rlkernel.linear_logp(hidden, weight, ids, bias=b, temperature=t, softcap=softcap, logit_scale=scale,
                                       return_entropy=True, batch_invariant=batch_invariant, backend="fused")
    assert rec.statuses("linear_logp.forward") == {"fused"}
    want_lp, want_ent, size = reference(hidden, weight, b, ids, t, scale, softcap)
    tol = tolerance(dtype, size, softcap)
    assert bool(((lp.double() - want_lp).abs() <= tol).all()), (lp.double() - want_lp).abs().max()
    assert bool(((ent.double() - want_ent).abs() <= tol * (1 + math.log(3001))).all())
    assert bool((lp[ids == IGNORE] == 0).all())


@pytest.mark.parametrize("per_row,softcap,scale", OPTIONS)
@pytest.mark.parametrize("chunk", [None, (48, 512)])
def test_fused_options_gradients_match_float64(fused, per_row, softcap, scale, chunk):
    hidden, weight, b, ids, t_rows = make(100, 48, 2001, torch.float32, seed=2)
    t = t_rows if per_row else 1.3
    g = torch.Generator(device="cuda").manual_seed(3)
    gl, gh = torch.randn(100, device="cuda", generator=g), torch.randn(100, device="cuda", generator=g)
    leaves = [a.clone().requires_grad_(True) for a in (hidden, weight, b)]
    ctx = fused.chunking(*chunk) if chunk else contextlib.nullcontext()
    with ctx:
        lp, ent = rlkernel.linear_logp(leaves[0], leaves[1], ids, bias=leaves[2], temperature=t, softcap=softcap,
                                       logit_scale=scale, return_entropy=True, backend="fused")
        torch.autograd.backward([lp, ent], [gl, gh])
    refs = [a.double().requires_grad_(True) for a in (hidden, weight, b)]
    rlp, rent, _ = reference(refs[0], refs[1], refs[2], ids, t, scale, softcap)
    torch.autograd.backward([rlp, rent], [gl.double(), gh.double()])
    for got, want, name in zip(leaves, refs, ("hidden", "weight", "bias"), strict=True):
        atol = 1e-4 * float(want.grad.abs().max()) + 1e-5
        torch.testing.assert_close(got.grad.double(), want.grad, atol=atol, rtol=0, msg=name)
    assert bool((leaves[0].grad[ids == IGNORE] == 0).all())


@pytest.mark.parametrize("per_row,softcap,scale", OPTIONS)
def test_fused_and_native_agree(fused, per_row, softcap, scale):
    hidden, weight, b, ids, t_rows = make(64, 64, 4097, torch.bfloat16, seed=4)
    t = t_rows if per_row else 0.9
    kw = dict(bias=b, temperature=t, softcap=softcap, logit_scale=scale, return_entropy=True)
    f = rlkernel.linear_logp(hidden, weight, ids, backend="fused", **kw)
    n = rlkernel.linear_logp(hidden, weight, ids, backend="native", **kw)
    _, _, size = reference(hidden, weight, b, ids, t, scale, softcap)
    tol = 2 * tolerance(torch.bfloat16, size, None)  # the native path rounds logits to bf16 before the softcap
    for a, c, name in zip(f, n, ("logp", "entropy"), strict=True):
        assert bool(((a - c).abs().double() <= tol * (1 + math.log(4097))).all()), name


def test_entropy_without_ids_runs_fused_and_equals_the_entropy_with_ids(fused):
    hidden, weight, b, ids, t_rows = make(90, 64, 3001, torch.bfloat16, seed=5)
    x = hidden.clone().requires_grad_(True)
    with dispatch.recording() as rec:
        ent = rlkernel.linear_logp(x, weight, None, bias=b, temperature=t_rows, return_entropy=True,
                                   backend="fused", ignore_index=0)  # ignore_index has no say without ids
    assert rec.statuses("linear_logp.forward") == {"fused"}
    _, with_ids = rlkernel.linear_logp(hidden, weight, ids, bias=b, temperature=t_rows, return_entropy=True,
                                       backend="fused")
    keep = ids != IGNORE
    assert torch.equal(ent[keep].detach(), with_ids[keep])  # the fold's entropy does not depend on the id
    assert bool((ent[~keep] > 0).all())
    ent.sum().backward()
    assert bool(torch.isfinite(x.grad).all()) and float(x.grad.abs().sum()) > 0


def test_outputs_entropy_alone_runs_fused_bitwise_as_return_entropy(fused):
    hidden, weight, b, ids, _ = make(50, 64, 2049, torch.bfloat16, seed=6)
    out = rlkernel.linear_logp(hidden, weight, ids, bias=b, outputs=("entropy",), backend="fused")
    lp, ent = rlkernel.linear_logp(hidden, weight, ids, bias=b, return_entropy=True, backend="fused")
    assert torch.equal(out.logp, lp) and torch.equal(out.entropy, ent) and out.is_top1 is None


def test_extra_statistics_run_fused_by_default(fused):
    """The three statistics have a fused kernel now (fold_extras; tests/test_linear_logp_extras_gpu.py checks its
    values): backend "auto" and a demanded fused path both run it, recorded fused."""
    hidden, weight, b, ids, t = make(40, 64, 2049, torch.bfloat16, seed=7)
    with dispatch.recording() as rec:
        out = rlkernel.linear_logp(hidden, weight, ids, bias=b, temperature=t, outputs=OUTPUT_NAMES)
    (r, _), = [x for x in rec.records if x[0].op == "linear_logp.forward"]
    assert (r.backend, r.status) == ("fused", "fused")
    want_lp, want_ent, size = reference(hidden, weight, b, ids, t)
    assert bool(((out.logp.double() - want_lp).abs() <= tolerance(torch.bfloat16, size, None)).all())
    assert out.is_top1.dtype == torch.bool and out.mean_logit.dtype == torch.float32
    with dispatch.recording() as rec:
        only = rlkernel.linear_logp(hidden, weight, ids, outputs=("mean_logit",), backend="fused")
    assert rec.statuses("linear_logp.forward") == {"fused"}
    assert only.logp is not None and only.entropy is None and only.log_sum_sq_probs is None and only.is_top1 is None


@pytest.mark.parametrize("backend", ["fused", "native"])
def test_bad_per_row_temperature_goes_to_the_error_record_without_a_sync(fused, backend):
    hidden, weight, b, ids, t = make(64, 32, 1001, torch.bfloat16, seed=8)
    t[9] = 0.0
    t[20] = float("nan")
    x = hidden.clone().requires_grad_(True)
    rlkernel.check_errors()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lp, ent = rlkernel.linear_logp(x, weight, ids, bias=b, temperature=t, softcap=20.0, return_entropy=True,
                                       backend=backend)
        (lp.sum() + ent.sum()).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    bad = torch.zeros(64, dtype=torch.bool, device="cuda")
    bad[9] = bad[20] = True
    assert bool(lp[bad].isnan().all()) and bool(ent[bad].isnan().all())
    assert bool(torch.isfinite(lp[~bad]).all())
    assert bool(x.grad[9].isnan().all())
    with pytest.raises(ValueError, match=r"linear_logp.forward: temperature of row 9 is out of range: must be a "
                                         r"finite number > 0"):
        rlkernel.check_errors()


def test_bad_per_row_temperature_in_the_loss_goes_to_the_error_record(fused):
    hidden, weight, b, ids, t = make(64, 32, 1001, torch.bfloat16, seed=9)
    t[5] = -1.0
    rlkernel.check_errors()
    loss = rlkernel.linear_logp_loss(hidden, weight, ids, lambda lp, en, sl: -lp, bias=b, temperature=t)
    assert bool(loss.isnan())
    with pytest.raises(ValueError, match=r"linear_logp_loss: temperature of row 5"):
        rlkernel.check_errors()


@pytest.mark.parametrize("backend", ["fused", "native"])
def test_cuda_graph_replays_new_per_row_temperatures(fused, backend):
    """Captured once with a per-row T tensor and a softcap; new T values written into that tensor are what a replay
    computes (the graph reads the tensor, no value was baked in)."""
    hidden, weight, b, ids, t = make(300, 64, 3001, torch.bfloat16, seed=10)
    x = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    temps = t.clone()

    def step():
        x.grad = None
        w.grad = None
        lp, ent = rlkernel.linear_logp(x, w, ids, bias=b, temperature=temps, softcap=10.0, logit_scale=0.5,
                                       return_entropy=True, backend=backend)
        (lp.sum() - 0.01 * ent.sum()).backward()
        return lp.detach(), ent.detach(), x.grad, w.grad

    warm_on_side_stream(step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    temps.copy_(t.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    replayed = [c.clone() for c in captured]
    eager = step()
    for a, e in zip(replayed, eager, strict=True):
        assert torch.equal(a, e)


def test_loss_options_run_fused(fused):
    hidden, weight, b, ids, t = make(200, 64, 3001, torch.bfloat16, seed=11)
    adv = torch.randn(200, device="cuda")

    def loss_fn(lp, en, sl):
        return -lp * adv[sl]

    with dispatch.recording() as rec:
        fused_loss = rlkernel.linear_logp_loss(hidden, weight, ids, loss_fn, bias=b, temperature=0.9,
                                               logit_scale=0.5, chunk_size=64)
    assert rec.statuses("linear_logp_loss") == {"fused"}
    native_loss = rlkernel.linear_logp_loss(hidden, weight, ids, loss_fn, bias=b, temperature=0.9, logit_scale=0.5,
                                            chunk_size=64, backend="native")
    torch.testing.assert_close(fused_loss, native_loss, atol=0.05, rtol=1e-3)  # bf16 logits, 200 rows
    with dispatch.recording() as rec:
        rlkernel.linear_logp_loss(hidden, weight, ids, loss_fn, bias=b, temperature=t, softcap=30.0)
    (r, _), = rec.records
    assert (r.status, r.backend) == ("fused", "fused")  # a per-row T and a softcap: the option kernels
