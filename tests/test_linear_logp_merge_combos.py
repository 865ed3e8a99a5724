"""Combinations of linear_logp's merged features (mixed precision, mask, per-row temperature, options, processed
mode) against a float64 reference computed by hand: the cases the op-precision / processed-linear merges broke."""
import pytest
import torch

from rlkernel import linear_logp

V, H = 37, 16


def _inputs(hidden_dtype, weight_dtype, n=10):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, H, generator=g).to(hidden_dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.3).to(weight_dtype).requires_grad_()
    ids = torch.randint(0, V, (n,), generator=g)
    return hidden, weight, ids


def _reference(hidden, weight, ids, temperature, compute, keep=None):
    """log-probs (0 off ``keep``) and the gradients of their sum in float64, from the operands rounded to the
    compute dtype."""
    h = hidden.detach().to(compute).double().requires_grad_()
    w = weight.detach().to(compute).double().requires_grad_()
    lp = torch.log_softmax((h @ w.t()) / temperature.double()[:, None], -1).gather(-1, ids[:, None]).squeeze(-1)
    if keep is not None:
        lp = torch.where(keep, lp, 0.0)
    return lp.detach(), torch.autograd.grad(lp.sum(), (h, w))


@pytest.mark.parametrize("mask", [False, True])
def test_float64_hidden_float32_weight_per_row_temperature(mask):
    # compute dtype float32 (the lowest precision): the per-row temperature must be float32 too, or the backward's
    # float64 logits gradient meets the float32 weight in one GEMM (a dtype error before the fix)
    hidden, weight, ids = _inputs(torch.float64, torch.float32)
    temperature = torch.rand(10, generator=torch.Generator().manual_seed(1)) + 0.5
    keep = torch.ones(10, dtype=torch.bool)
    if mask:
        keep[[0, 3, 7]] = False
    lp = linear_logp(hidden, weight, ids, temperature=temperature, backend="native",
                     mask=keep if mask else None)
    ref, (ref_dh, ref_dw) = _reference(hidden, weight, ids, temperature, torch.float32, keep)
    assert (lp.double() - ref).abs().max() < 1e-5
    dh, dw = torch.autograd.grad(lp.sum(), (hidden, weight))
    assert dh.dtype == torch.float64 and dw.dtype == torch.float32
    assert (dh - ref_dh).abs().max() < 1e-4
    assert (dw.double() - ref_dw).abs().max() < 1e-4
    assert not dh[~keep].any()


def test_float64_hidden_float32_weight_per_row_temperature_under_autocast():
    # float64 inputs leave autocast out: the same float32 compute, the same fix
    hidden, weight, ids = _inputs(torch.float64, torch.float32)
    temperature = torch.rand(10, generator=torch.Generator().manual_seed(1)) + 0.5
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp = linear_logp(hidden, weight, ids, temperature=temperature, backend="native")
    ref, (ref_dh, ref_dw) = _reference(hidden, weight, ids, temperature, torch.float32)
    assert (lp.double() - ref).abs().max() < 1e-5
    dh, dw = torch.autograd.grad(lp.sum(), (hidden, weight))
    assert (dh - ref_dh).abs().max() < 1e-4 and (dw.double() - ref_dw).abs().max() < 1e-4
