"""GPU tests of linear_logp's fused extra statistics (``outputs``: log_sum_sq_probs, mean_logit, is_top1;
rlkernel_linear_logp_fold_extras_kernel) on CUDA (skipped without it; a CUDA machine without the build fails).

Against float64 of the exact product of the same 16-bit inputs (``reference``), on fresh random inputs with realistic
logits (|z| up to ~20), a per-row temperature, the softcap, logit_scale, ignored rows, masks and several vocabulary
chunks (small forced chunk sizes), and exact argmax ties.

Tolerances: each logit carries at most one unit roundoff u |x| of the tile's dtype (bf16 u = 2^-8; float32 and
every softcapped tile, which is float32: ~2^-20 with TF32 off), so z' moves by at most d = u max|x| / T per row
(``size``). log sum p^2 has gradient 2 p_j (p_j / sum p^2 - 1) in z'_j, of 1-norm <= 4: it moves by <= 4 d, plus the
float32 fold (3e-5 + 1e-5 |value|). mean z' moves by <= d, plus the float32 sum of V terms (V 2^-24 max|z'|).
is_top1 equals float64's argmax test wherever the row's top two float64 logits are more than 2 d apart, and on the
constructed exact ties (integer-valued products: every GEMM gives them exactly).
"""
from __future__ import annotations

import contextlib
import math

import pytest
import torch

import rlkernel
from rlkernel import dispatch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

IGNORE = -100
UNIT = {torch.float32: 2.0 ** -20, torch.bfloat16: 2.0 ** -8}
STATS = ("log_sum_sq_probs", "mean_logit", "is_top1")


def tie_columns(v):
    """Weight rows made equal: the first is the argmax, the second (same chunk) and the third (a later one) never."""
    return [100, 101, v - 500]


def make(n, h, v, dtype, *, seed, scale=6.0):
    """Fresh inputs (never zeros) with logits of std ~scale; rows 0..5 tied at tie_columns: small-integer hidden and
    weight rows there (exact products in any GEMM), larger than every other logit; rows 10..29 have their argmax as
    id (is_top1 true without a tie)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, h, device="cuda", generator=g)
    weight = torch.randn(v, h, device="cuda", generator=g) * scale / math.sqrt(h)
    bias = torch.randn(v, device="cuda", generator=g) * 0.5
    tie = torch.randint(-2, 3, (h,), device="cuda", generator=g).float()
    tie[0] = 3.0  # never all zeros
    cols = tie_columns(v)
    weight[cols] = tie
    bias[cols] = 0.25
    hidden[:6] = tie
    ids = torch.randint(0, v, (n,), device="cuda", generator=g)
    ids[:6] = torch.tensor(cols + cols, device="cuda")
    x = hidden.to(dtype).double() @ weight.to(dtype).double().t() + bias.to(dtype).double()
    ids[10:30] = x[10:30].argmax(-1)
    ids[7] = ids[n // 2] = IGNORE
    t = torch.rand(n, device="cuda", generator=g) * 1.5 + 0.4
    return hidden.to(dtype), weight.to(dtype), bias.to(dtype), ids, t


def reference(hidden, weight, bias, ids, temperature, scale=1.0, softcap=None):
    """float64 (log_sum_sq, mean, is_top1, top-two gap of z', max |z'|) of the exact product; ids None: no is_top1."""
    x = hidden.double() @ weight.double().t() + bias.double()
    z = x * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    t = temperature.double()[:, None] if isinstance(temperature, torch.Tensor) else temperature
    z = z / t
    lss = torch.logsumexp(2 * torch.log_softmax(z, -1), -1)
    mean = z.mean(-1)
    top2 = z.topk(2, -1).values
    top1 = None if ids is None else z.argmax(-1) == ids
    return lss, mean, top1, top2[:, 0] - top2[:, 1], z.abs().amax(-1)


def check(out, want, ids, tile_dtype, keep, vocab):
    """The statistics of ``out`` against ``reference``'s, on the rows ``keep`` (others: 0 / False)."""
    lss, mean, top1, gap, size = want
    d = UNIT[tile_dtype] * size
    valid = keep if ids is None else keep & (ids != IGNORE)
    got_lss, got_mean = out.log_sum_sq_probs.double(), out.mean_logit.double()
    err_lss = (got_lss - lss).abs()[valid]
    assert bool((err_lss <= 4 * d[valid] + 3e-5 + 1e-5 * lss.abs()[valid]).all()), err_lss.max()
    err_mean = (got_mean - mean).abs()[valid]
    assert bool((err_mean <= d[valid] + vocab * 2.0 ** -24 * size[valid] + 1e-6).all()), err_mean.max()
    assert bool((got_lss[~valid] == 0).all()) and bool((got_mean[~valid] == 0).all())
    if top1 is not None:
        clear = valid & ((gap > 2 * d) | (gap == 0))
        assert torch.equal(out.is_top1[clear], top1[clear])
        assert not bool(out.is_top1[~valid].any())
        tied = torch.zeros_like(valid)
        tied[:6] = True
        tied &= valid
        first = tie_columns(vocab)[0]
        assert torch.equal(out.is_top1[tied], (ids == first)[tied])  # the first column of the tie only
        assert bool(out.is_top1[10:30][clear[10:30]].all())  # ids set to the (clear) argmax


OPTIONS = [  # (per-row temperature, softcap, logit_scale)
    (True, None, 1.0), (False, None, 1.0), (False, 30.0, 1.0), (True, 5.0, 0.5), (False, None, 0.0625)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("per_row,softcap,scale", OPTIONS)
@pytest.mark.parametrize("chunk,batch_invariant,masked", [
    ((48, 512), False, False), ((48, 512), False, True), (None, False, False), ((4096, 1024), True, False)])
def test_fused_statistics_match_float64(fused_linear, dtype, per_row, softcap, scale, chunk, batch_invariant,
                                        masked):
    n, v = 150, 4001  # (48, 512): 4 row blocks x 8 vocabulary chunks, the tie across chunks (100 / 2500)
    hidden, weight, b, ids, t_rows = make(n, 64, v, dtype, seed=11 + int(per_row) + 3 * int(masked))
    t = t_rows if per_row else 0.7
    mask = (torch.arange(n) % 5 != 3) if masked else None  # a CPU mask: no host sync
    ctx = fused_linear.chunking(*chunk) if chunk else contextlib.nullcontext()
    with ctx, dispatch.recording() as rec:
        out = rlkernel.linear_logp(hidden, weight, ids, bias=b, temperature=t, softcap=softcap, logit_scale=scale,
                                   outputs=("entropy",) + STATS, batch_invariant=batch_invariant, backend="fused",
                                   mask=mask)
    assert rec.statuses("linear_logp.forward") == {"fused"}
    assert out.is_top1.dtype == torch.bool and out.log_sum_sq_probs.dtype == out.mean_logit.dtype == torch.float32
    keep = torch.ones(n, dtype=torch.bool, device="cuda") if mask is None else mask.cuda()
    tile = torch.float32 if softcap is not None else dtype
    check(out, reference(hidden, weight, b, ids, t, scale, softcap), ids, tile, keep, v)


def test_fused_statistics_without_ids(fused_linear):
    hidden, weight, b, _, t = make(90, 64, 3001, torch.bfloat16, seed=21)
    with dispatch.recording() as rec, fused_linear.chunking(32, 768):
        out = rlkernel.linear_logp(hidden, weight, None, bias=b, temperature=t, outputs=STATS[:2], backend="fused")
    assert rec.statuses("linear_logp.forward") == {"fused"}
    assert out.logp is None and out.entropy is None and out.is_top1 is None
    keep = torch.ones(90, dtype=torch.bool, device="cuda")
    check(out, reference(hidden, weight, b, None, t), None, torch.bfloat16, keep, 3001)


def test_statistics_change_nothing_else_and_carry_no_gradient(fused_linear):
    """A per-row T runs the row kernels with or without outputs: logp, entropy and the gradients are those of the
    call without them (the extras kernel's fold is fold_rows' source: equal up to the compiler's scheduling, in
    practice bitwise); the statistics are not differentiable."""
    hidden, weight, b, ids, t = make(120, 64, 3001, torch.bfloat16, seed=31)
    g = torch.Generator(device="cuda").manual_seed(32)
    gl, gh = torch.randn(120, device="cuda", generator=g), torch.randn(120, device="cuda", generator=g)
    results = []
    for outputs in ((), STATS):
        x, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        with fused_linear.chunking(40, 1024):
            res = rlkernel.linear_logp(x, w, ids, bias=b, temperature=t, return_entropy=True, outputs=outputs,
                                       backend="fused")
        lp, ent = res[0], res[1]
        torch.autograd.backward([lp, ent], [gl, gh])
        results.append((lp.detach(), ent.detach(), x.grad, w.grad))
        if outputs:
            assert not any(getattr(res, f).requires_grad for f in STATS)
    for a, c in zip(*results, strict=True):
        torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-7)


def test_fused_and_native_statistics_agree(fused_linear):
    hidden, weight, b, ids, t = make(64, 64, 4097, torch.bfloat16, seed=41)
    kw = dict(bias=b, temperature=t, softcap=20.0, logit_scale=0.5, outputs=STATS)
    with fused_linear.chunking(64, 1024):
        f = rlkernel.linear_logp(hidden, weight, ids, backend="fused", **kw)
    nat = rlkernel.linear_logp(hidden, weight, ids, backend="native", **kw)
    *_, gap, size = reference(hidden, weight, b, ids, t, 0.5, 20.0)
    d = 2 * UNIT[torch.bfloat16] * size  # the native path softcaps bf16-rounded logits, the fused one float32 ones
    assert bool(((f.log_sum_sq_probs - nat.log_sum_sq_probs).abs().double() <= 4 * d + 1e-4).all())
    assert bool(((f.mean_logit - nat.mean_logit).abs().double() <= d + 1e-4).all())
    clear = (gap > 2 * d) | (gap == 0)
    assert torch.equal(f.is_top1[clear], nat.is_top1[clear])


def test_batch_invariant_statistics_do_not_depend_on_the_batch(fused_linear):
    hidden, weight, b, ids, t = make(200, 64, 3001, torch.bfloat16, seed=51)
    kw = dict(bias=b, outputs=STATS, batch_invariant=True, backend="fused")
    full = rlkernel.linear_logp(hidden, weight, ids, temperature=t, **kw)
    part = rlkernel.linear_logp(hidden[37:90], weight, ids[37:90], temperature=t[37:90], **kw)
    for name in STATS:
        assert torch.equal(getattr(full, name)[37:90], getattr(part, name)), name


def test_statistics_without_a_host_sync_and_bad_rows(fused_linear):
    """No host sync (sync debug mode "error"); a bad per-row temperature and a bad id: NaN statistics, is_top1 False,
    the device error record; ignored rows 0 / False."""
    hidden, weight, b, ids, t = make(64, 32, 1001, torch.bfloat16, seed=61)
    t[9] = 0.0
    ids[20] = 5000
    rlkernel.check_errors()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with fused_linear.chunking(64, 256):
            out = rlkernel.linear_logp(hidden, weight, ids, bias=b, temperature=t, softcap=15.0, outputs=STATS,
                                       backend="fused")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for row in (9, 20):
        assert bool(out.log_sum_sq_probs[row].isnan()) and bool(out.mean_logit[row].isnan())
        assert not bool(out.is_top1[row])
    assert float(out.log_sum_sq_probs[7]) == 0.0 and not bool(out.is_top1[7])
    good = torch.ones(64, dtype=torch.bool, device="cuda")
    good[[7, 9, 20]] = False
    assert bool(torch.isfinite(out.log_sum_sq_probs[good]).all())
    with pytest.raises((ValueError, IndexError)):
        rlkernel.check_errors()
