"""GPU tests of mixed precision, autocast, grad_accumulation and row masks on the fused paths of rlkernel.linear_logp
and rlkernel.linear_logp_loss (skipped without CUDA; a CUDA machine without the build fails).

Bitwise where the arithmetic is the same: a mixed-dtype or autocast call runs the GEMMs of the explicit bf16 call
(the same operands, shapes and accumulators), so its forward equals that call's bit for bit and its float32 dH / db,
rounded to bf16 (round to nearest even, as the op's cast kernel rounds), equal that call's bf16 ones; its dW (a
float32-output GEMM where the bf16 call's writes bf16) within one bf16 unit.
float32 dW accumulation over many row blocks: bitwise the float32 accumulator (what a float32 weight gets back)
rounded once, and closer to it on average than "input" (one rounding per block).
Masks with batch_invariant=True: the kept rows bitwise those of the unmasked call (a row's results do not depend on
the other rows), and the profiler shows every GEMM with the kept row count.
"""
from __future__ import annotations

import contextlib
import math

import pytest
import torch

import rlkernel
from rlkernel.ops import row_mask

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

IGNORE = -100


@pytest.fixture(scope="module")
def fused():
    from rlkernel import _ext

    reason = _ext.unavailable_reason()
    if reason:  # a GPU without the build is a setup problem, not a pass
        pytest.fail(f"CUDA is available but rlkernel._C is not: {reason} (python setup.py build_ext --inplace)")
    from rlkernel.ops.fused import linear_logp as fused_mod

    rlkernel.check_errors()
    yield fused_mod
    with contextlib.suppress(IndexError, ValueError):
        rlkernel.check_errors()


def make(n, h, v, dtype=torch.float32, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, device="cuda").to(dtype)
    weight = (torch.randn(v, h, generator=g, device="cuda") * 3 / math.sqrt(h)).to(dtype)
    bias = (torch.randn(v, generator=g, device="cuda") * 0.5).to(dtype)
    ids = torch.randint(0, v, (n,), generator=g, device="cuda")
    ids[1] = IGNORE
    return hidden, weight, bias, ids


def leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


def step(h, w, b, ids, **kw):
    lp, ent = rlkernel.linear_logp(h, w, ids, bias=b, return_entropy=True, backend="fused", require_fused=True, **kw)
    g = torch.linspace(-1, 1, lp.numel(), device="cuda")
    (g * lp + 0.3 * ent).sum().backward()
    return lp, ent


@pytest.mark.parametrize("case", ["mixed", "autocast"])
def test_fused_mixed_and_autocast_run_the_bf16_gemms_both_ways(fused, case):
    h32, w32, b32, ids = make(300, 128, 1000)
    if case == "mixed":
        h, w, b = leaves(h32.bfloat16(), w32, b32)
        lp, ent = step(h, w, b, ids)
    else:
        h, w, b = leaves(h32, w32, b32)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            lp, ent = step(h, w, b, ids)
    assert (h.grad.dtype, w.grad.dtype, b.grad.dtype) == (h.dtype, w.dtype, b.dtype)
    h16, w16, b16 = leaves(h32.bfloat16(), w32.bfloat16(), b32.bfloat16())
    lp16, ent16 = step(h16, w16, b16, ids)
    assert torch.equal(lp, lp16) and torch.equal(ent, ent16)
    for got, want in ((h.grad, h16.grad), (b.grad, b16.grad)):  # the same accumulators, rounded the same way
        assert torch.equal(got.bfloat16(), want)
    # dW: one row block, so the bf16 call writes the GEMM's bf16 output and the float32 weight its float32 one;
    # cuBLAS may pick another algorithm per output type, so within one bf16 unit of the float32 value
    err = (w16.grad.double() - w.grad.double()).abs()
    assert (err <= 2.0 ** -8 * w.grad.double().abs() + 1e-6 * w.grad.abs().max().item()).all()


def test_fused_float32_accumulation_over_many_blocks(fused):
    n, hs, v = 1024, 64, 512
    h, w, b, ids = make(n, hs, v, torch.bfloat16, seed=2)
    grads = {}
    with fused.chunking(64, 256):  # 16 row blocks, 2 vocabulary chunks
        for mode in ("float32", "input"):
            hh, ww, bb = leaves(h, w, b)
            step(hh, ww, bb, ids, grad_accumulation=mode)
            assert ww.grad.dtype == torch.bfloat16
            grads[mode] = ww.grad
        # a float32 weight (bf16 compute: the same GEMMs) gets the float32 accumulator itself
        hh, ww, bb = leaves(h, w.float(), b.float())
        step(hh, ww, bb, ids)
        want = ww.grad
    assert torch.equal(grads["float32"], want.bfloat16())  # the float32 sum rounded once
    err32 = (grads["float32"].double() - want.double()).abs().mean()
    err_in = (grads["input"].double() - want.double()).abs().mean()
    assert err_in > 2 * err32, (err_in, err32)  # 16 roundings of a running bf16 sum


def test_fused_mask_matches_unmasked_rows_bitwise(fused):
    n, hs, v = 200, 64, 700
    h, w, b, ids = make(n, hs, v, torch.bfloat16, seed=3)
    mask = torch.rand(n) > 0.5  # a CPU mask: no host sync
    mask[0] = True
    hm, wm, bm = leaves(h, w, b)
    before = row_mask.host_syncs
    lp_m, ent_m = step(hm, wm, bm, ids, mask=mask, batch_invariant=True)
    assert row_mask.host_syncs == before
    hf, wf, bf = leaves(h, w, b)
    lp_f, ent_f = step(hf, wf, bf, torch.where(mask.cuda(), ids, IGNORE), batch_invariant=True)
    mc = mask.cuda()
    assert torch.equal(lp_m[mc], lp_f[mc]) and torch.equal(ent_m[mc], ent_f[mc])
    assert (lp_m[~mc] == 0).all() and (ent_m[~mc] == 0).all() and (hm.grad[~mc] == 0).all()
    assert torch.equal(hm.grad[mc], hf.grad[mc])
    # a device mask: the same rows, one host sync for the count
    hd, wd, bd = leaves(h, w, b)
    lp_d, _ = step(hd, wd, bd, ids, mask=mc, batch_invariant=True)
    assert row_mask.host_syncs == before + 1
    assert torch.equal(lp_d, lp_m) and torch.equal(hd.grad, hm.grad)


def gemm_shapes(fn):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return [(e.name, e.input_shapes) for e in prof.events()
            if e.name.split("::")[-1].split(".")[0] in ("mm", "addmm", "mv", "addmv")]


@pytest.mark.parametrize("op", ["linear_logp", "linear_logp_loss"])
def test_fused_masked_rows_do_no_gemm_work(fused, op):
    """Every GEMM of the call (forward and backward) has the kept row count (40), none the full one (96)."""
    n, kept, hs, v = 96, 40, 64, 320
    h, w, b, ids = make(n, hs, v, torch.bfloat16, seed=4)
    mask = torch.zeros(n, dtype=torch.bool)
    mask[torch.randperm(n)[:kept]] = True

    def call():
        hh, ww, bb = leaves(h, w, b)
        if op == "linear_logp":
            step(hh, ww, bb, ids, mask=mask)
        else:
            rlkernel.linear_logp_loss(hh, ww, ids, lambda lp, en, sl: -lp, bias=bb, mask=mask, backend="fused",
                                      require_fused=True).backward()
        torch.cuda.synchronize()

    call()  # warm-up: the one-time GEMM probes (2 x 2) stay out of the profile
    shapes = gemm_shapes(call)
    assert shapes, "no GEMM seen by the profiler"
    dims = [d for _, ins in shapes for s in ins for d in s]
    assert kept in dims and n not in dims, shapes


def test_fused_loss_mixed_precision_and_accumulation(fused):
    h32, w32, b32, ids = make(500, 64, 800, seed=5)
    adv = torch.randn(500, device="cuda")

    def fn(lp, en, sl):
        return -lp * adv[sl] - 0.1 * en

    h, w, b = leaves(h32.bfloat16(), w32, b32)
    loss = rlkernel.linear_logp_loss(h, w, ids, fn, bias=b, chunk_size=128, backend="fused", require_fused=True)
    loss.backward()
    assert (h.grad.dtype, w.grad.dtype, b.grad.dtype) == (torch.bfloat16, torch.float32, torch.float32)
    h16, w16, b16 = leaves(h32.bfloat16(), w32.bfloat16(), b32.bfloat16())
    loss16 = rlkernel.linear_logp_loss(h16, w16, ids, fn, bias=b16, chunk_size=128, backend="fused")
    loss16.backward()
    assert torch.equal(loss, loss16) and torch.equal(h.grad, h16.grad)
    assert torch.equal(w.grad.bfloat16(), w16.grad) and torch.equal(b.grad.bfloat16(), b16.grad)
    hi, wi, bi = leaves(h32.bfloat16(), w32.bfloat16(), b32.bfloat16())
    rlkernel.linear_logp_loss(hi, wi, ids, fn, bias=bi, chunk_size=128, backend="fused",
                              grad_accumulation="input").backward()
    want = w.grad.double()
    assert (wi.grad.double() - want).abs().mean() > (w16.grad.double() - want).abs().mean()


def test_cpu_mask_costs_no_host_sync(fused):
    h, w, b, ids = make(128, 32, 500, torch.bfloat16, seed=6)
    mask = torch.arange(128) % 3 != 0
    x = h.clone().requires_grad_(True)
    step(x, w, b, ids, mask=mask)  # warm-up (probes, pinned pool)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        x.grad = None
        step(x, w, b, ids, mask=mask)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_masks_under_cuda_graph_capture(fused):
    """A device mask is captured as ignored rows (no compaction, no sync); a CPU mask is refused there."""
    from cuda_graphs import warm_on_side_stream

    h, w, b, ids = make(200, 64, 900, torch.bfloat16, seed=7)
    mask = (torch.arange(200, device="cuda") % 2) == 0
    x = h.clone().requires_grad_(True)

    def run(m):
        x.grad = None
        lp, ent = rlkernel.linear_logp(x, w, ids, bias=b, return_entropy=True, backend="fused", mask=m)
        (lp.sum() - 0.01 * ent.sum()).backward()
        return lp.detach(), ent.detach(), x.grad

    warm_on_side_stream(lambda: run(mask))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run(mask)
    graph.replay()
    torch.cuda.synchronize()
    x.grad = None
    lp, ent = rlkernel.linear_logp(x, w, torch.where(mask, ids, IGNORE), bias=b, return_entropy=True,
                                   backend="fused")
    (lp.sum() - 0.01 * ent.sum()).backward()
    for a, e in zip(captured, (lp, ent, x.grad), strict=True):
        assert torch.equal(a, e)
    cpu_mask = mask.cpu()  # before the capture: a device-to-host copy is itself illegal while capturing
    graph2 = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="CPU mask cannot be used under CUDA-graph capture"):
        with torch.cuda.graph(graph2):
            run(cpu_mask)
