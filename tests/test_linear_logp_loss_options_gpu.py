"""GPU tests of the fused rlkernel.linear_logp_loss with a per-row temperature and the softcap (linear_logp's option
kernels on each chunk's [chunk, V] logits) on CUDA (skipped without it; a CUDA machine without the build fails).

Against float64 of the exact product of the same inputs, fresh random inputs with realistic logits, several token
chunks (small chunk_size), ignored rows and a CPU mask. Tolerances as tests/test_linear_logp_options_gpu.py's: a
row's logp and entropy move by at most 2 u max|x| / T (u: the logits' unit roundoff; softcapped logits are float32)
plus 3e-5, the entropy times (1 + log V); the loss by those times |d loss / d logp|, |d loss / d entropy|; the
gradients (float32 inputs) within 1e-4 of their largest element plus 1e-5.
"""
from __future__ import annotations

import math

import pytest
import torch

import rlkernel
from rlkernel import dispatch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

IGNORE = -100
UNIT = {torch.float32: 2.0 ** -20, torch.bfloat16: 2.0 ** -8}
OPTIONS = [  # (per-row temperature, softcap, logit_scale)
    (True, None, 1.0), (False, 30.0, 1.0), (True, 5.0, 0.5), (True, None, 0.25)]


def make(n, h, v, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, h, device="cuda", generator=g).to(dtype)
    weight = (torch.randn(v, h, device="cuda", generator=g) * 6.0 / math.sqrt(h)).to(dtype)
    bias = (torch.randn(v, device="cuda", generator=g) * 0.5).to(dtype)
    ids = torch.randint(0, v, (n,), device="cuda", generator=g)
    ids[3] = ids[n // 2] = IGNORE
    t = torch.rand(n, device="cuda", generator=g) * 1.5 + 0.4
    adv = torch.randn(n, device="cuda", generator=g)
    return hidden, weight, bias, ids, t, adv


def loss_fn_of(adv):
    return lambda lp, en, sl: -lp * adv[sl] - 0.1 * en


def reference(hidden, weight, bias, ids, t, scale, softcap, adv, keep, logits_dtype=None):
    """float64 (mean loss, per-row max |z'|, leaves with .grad) over the kept, not ignored rows. ``logits_dtype``:
    the GEMM's logits rounded to it first, as the fused pass rounds them (bf16 compute without a softcap), with the
    gradient passed straight through the rounding: the comparison then measures the kernels' arithmetic, not bf16's
    rounding of logits up to |z| / T ~ 60 (which moved the hidden gradient past 3e-2 of its largest element on the
    H200 with a per-row temperature down to 0.4)."""
    leaves = [a.detach().double().requires_grad_(True) for a in (hidden, weight, bias)]
    z = leaves[0] @ leaves[1].t() + leaves[2]
    if logits_dtype is not None:
        z = z + (z.detach().to(logits_dtype).double() - z.detach())
    z = z * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / (t.double()[:, None] if isinstance(t, torch.Tensor) else t)
    lp_all = torch.log_softmax(z, -1)
    valid = keep & (ids != IGNORE)
    lp = lp_all.gather(-1, torch.where(valid, ids, 0)[:, None])[:, 0]
    ent = -(lp_all.exp() * lp_all).sum(-1)
    per_row = torch.where(valid, -lp * adv.double() - 0.1 * ent, 0.0)
    loss = per_row.sum() / valid.sum().clamp_min(1)
    loss.backward()
    return loss.detach(), z.detach().abs().amax(-1), leaves


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("per_row,softcap,scale", OPTIONS)
@pytest.mark.parametrize("masked", [False, True])
def test_fused_loss_options_match_float64(fused_linear, dtype, per_row, softcap, scale, masked):
    n, v = 150, 3001
    hidden, weight, b, ids, t_rows, adv = make(n, 64, v, dtype, seed=3 + int(per_row) + 2 * int(masked))
    t = t_rows if per_row else 0.8
    mask = (torch.arange(n) % 4 != 1) if masked else None  # a CPU mask: no host sync
    leaves = [a.clone().requires_grad_(True) for a in (hidden, weight, b)]
    with dispatch.recording() as rec:
        loss = rlkernel.linear_logp_loss(leaves[0], leaves[1], ids, loss_fn_of(adv), bias=leaves[2], temperature=t,
                                         softcap=softcap, logit_scale=scale, chunk_size=48, mask=mask,
                                         reduction="mean", backend="fused")
        loss.backward()
    assert rec.statuses("linear_logp_loss") == {"fused"}
    keep = torch.ones(n, dtype=torch.bool, device="cuda") if mask is None else mask.cuda()
    rounded = torch.bfloat16 if dtype == torch.bfloat16 and softcap is None else None  # softcapped: float32 logits
    want, size, refs = reference(hidden, weight, b, ids, t, scale, softcap, adv, keep, rounded)
    valid = keep & (ids != IGNORE)
    u = UNIT[torch.float32] if softcap is not None else UNIT[dtype]  # softcapped logits: float32
    row_tol = (2 * u * size + 3e-5) * (adv.double().abs() + 0.1 * (1 + math.log(v)))
    tol = float(row_tol[valid].sum() / valid.sum())
    got = float(loss.detach())
    assert abs(got - float(want)) <= tol, (got, float(want), tol)
    for got, ref, name in zip(leaves, refs, ("hidden", "weight", "bias"), strict=True):
        rel = 1e-4 if dtype == torch.float32 else 3e-2  # bf16: the gradient tile rounded to bf16 for the GEMMs
        atol = rel * float(ref.grad.abs().max()) + 1e-5
        torch.testing.assert_close(got.grad.double(), ref.grad, atol=atol, rtol=0, msg=name)
    assert bool((leaves[0].grad[~valid] == 0).all())


def test_fused_loss_options_agree_with_native(fused_linear):
    hidden, weight, b, ids, t, adv = make(200, 64, 4097, torch.bfloat16, seed=11)
    kw = dict(bias=b, temperature=t, softcap=20.0, logit_scale=0.5, chunk_size=64)
    f = rlkernel.linear_logp_loss(hidden, weight, ids, loss_fn_of(adv), backend="fused", **kw)
    nat = rlkernel.linear_logp_loss(hidden, weight, ids, loss_fn_of(adv), backend="native", **kw)
    torch.testing.assert_close(f, nat, atol=0.1, rtol=2e-3)  # 198 rows: bf16 (native) vs float32 (fused_linear) logits


def test_fused_loss_options_without_a_host_sync(fused_linear):
    hidden, weight, b, ids, t, adv = make(96, 32, 1001, torch.bfloat16, seed=12)
    x = hidden.clone().requires_grad_(True)
    rlkernel.check_errors()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with dispatch.recording() as rec:
            loss = rlkernel.linear_logp_loss(x, weight, ids, loss_fn_of(adv), bias=b, temperature=t, softcap=15.0,
                                             chunk_size=32)
            loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert rec.statuses("linear_logp_loss") == {"fused"}
    assert bool(torch.isfinite(loss)) and bool(torch.isfinite(x.grad).all())
    rlkernel.check_errors()
