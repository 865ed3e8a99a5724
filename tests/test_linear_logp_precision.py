"""Mixed precision, autocast, grad_accumulation and row masks of rlkernel.linear_logp / linear_logp_loss on the
native backend (CPU): float64 references.

The references take the operands as the op must compute with them: cast to the compute dtype
(rlkernel.ops.precision), the logits the bf16 matmul's result (the op's forward GEMM on CPU is torch's bf16 matmul
of the same rows, so the forward is compared bitwise to an explicit bf16 call), then float64. Tolerances:
- logp / entropy against the explicitly cast call: bitwise (same rows, same GEMM, same float32 softmax);
- gradients against float64 of the compute-dtype operands and the op's bf16 logits: the native backward's
  float32 softmax terms and float32 GEMMs (1e-5 relative of the largest element), plus the output's rounding to
  its stored dtype (u = 2^-8 for bf16, 2^-24 for float32);
- the same gradients against float64 of the *uncast* float32 operands differ by the bf16 rounding of the operands
  (~2^-9 relative): the checks that the backward used the compute dtype, not the stored one.
"""
from __future__ import annotations

import math

import pytest
import torch

import rlkernel
from rlkernel.ops import precision, row_mask
from rlkernel.ops.native import linear_logp as native_mod

IGNORE = -100


def make(n, h, v, dtype=torch.float32, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64) * scale / math.sqrt(h)).to(dtype)
    bias = (torch.randn(v, generator=g, dtype=torch.float64) * 0.5).to(dtype)
    ids = torch.randint(0, v, (n,), generator=g)
    ids[1] = IGNORE
    return hidden, weight, bias, ids


def ref_grads(h, w, b, ids, gl, ge, temperature=1.0, logits=None):
    """float64 logp, entropy and (dh, dw, db) of sum(gl * logp + ge * entropy); ``logits``: the op's own (rounded)
    logits, whose rounding the gradient passes through."""
    h, w, b = (t.double().detach().requires_grad_() for t in (h, w, b))
    x = h @ w.t() + b
    if logits is not None:
        x = x + (logits.double() - x.detach())
    logp_all = torch.log_softmax(x / temperature, -1)
    valid = ids != IGNORE
    lp = torch.where(valid, logp_all.gather(-1, torch.where(valid, ids, 0)[:, None])[:, 0], 0.0)
    ent = torch.where(valid, -(logp_all.exp() * logp_all).sum(-1), 0.0)
    (gl * lp + ge * ent).sum().backward()
    return lp.detach(), ent.detach(), (h.grad, w.grad, b.grad)


def close(got, want, rel):
    scale = want.abs().max().item()
    err = (got.double() - want).abs().max().item()
    assert err <= rel * scale + 1e-12, (err, rel * scale)
    return err / scale


def leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


def run(h, w, b, ids, gl, ge, **kw):
    lp, ent = rlkernel.linear_logp(h, w, ids, bias=b, return_entropy=True, backend="native", **kw)
    (gl * lp + ge * ent).sum().backward()
    return lp, ent


def test_compute_dtype_rule():
    f32, bf16, f16, f64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
    t = lambda d: torch.zeros(1, 2, dtype=d)  # noqa: E731
    assert precision.compute_dtype(t(bf16), t(f32), t(f32)) == bf16  # the FSDP / autocast mixed case
    assert precision.compute_dtype(t(f32), t(bf16), None) == bf16
    assert precision.compute_dtype(t(f64), t(f32), None) == f32
    assert precision.compute_dtype(t(f16), t(f16), None) == f16
    with torch.autocast("cpu", dtype=bf16):
        assert precision.compute_dtype(t(f32), t(f32), t(f32)) == bf16
        assert precision.compute_dtype(t(f64), t(f64), None) == f64  # autocast leaves float64 alone
    with pytest.raises(TypeError, match="mixed bfloat16 and float16"):
        precision.compute_dtype(t(bf16), t(f16), None)
    assert precision.accumulation_dtype(bf16, bf16, "float32") == f32
    assert precision.accumulation_dtype(bf16, bf16, "input") == bf16
    assert precision.accumulation_dtype(f32, bf16, "input") == f32
    assert precision.accumulation_dtype(f64, f64, "input") == f64
    assert precision.accumulation_dtype(bf16, bf16, "float32", parts=1) == bf16  # one block: nothing to sum
    assert precision.accumulation_dtype(bf16, f16, "input") == f32  # a GEMM writes no bf16 from fp16 operands


@pytest.mark.parametrize("case", ["mixed", "autocast"])
def test_forward_and_backward_compute_in_bf16_grads_in_input_dtypes(case):
    n, hs, v = 24, 48, 80
    h32, w32, b32, ids = make(n, hs, v)
    g = torch.Generator().manual_seed(5)
    gl, ge = torch.randn(n, generator=g).double(), torch.randn(n, generator=g).double() * 0.3
    if case == "mixed":  # bf16 hidden states, float32 weight and bias (FSDP mixed precision / a float32 head)
        h, w, b = leaves(h32.bfloat16(), w32, b32)
        lp, ent = run(h, w, b, ids, gl.float(), ge.float())
    else:  # float32 everything under CPU autocast
        h, w, b = leaves(h32, w32, b32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp, ent = run(h, w, b, ids, gl.float(), ge.float())
    assert (h.grad.dtype, w.grad.dtype, b.grad.dtype) == (h.dtype, w.dtype, b.dtype)
    # the forward: bitwise the explicit bf16 call
    h16, w16, b16 = (t.detach().bfloat16() for t in (h, w, b))
    lp16, ent16 = rlkernel.linear_logp(h16, w16, ids, bias=b16, return_entropy=True, backend="native")
    assert torch.equal(lp, lp16) and torch.equal(ent, ent16)
    # the backward: float64 of the bf16 operands and bf16 logits, tight; of the float32 operands, off by bf16
    logits16 = torch.addmm(b16, h16, w16.t())
    _, _, want = ref_grads(h16, w16, b16, ids, gl, ge, logits=logits16)
    u_h = 2.0 ** -8 if h.dtype == torch.bfloat16 else 0.0
    close(h.grad, want[0], 1e-5 + u_h)
    close(w.grad, want[1], 1e-5)
    close(b.grad, want[2], 1e-5)
    if case == "autocast":  # float32 gradients: they show which operands the backward's GEMMs took
        _, _, want32 = ref_grads(h.detach(), w.detach(), b.detach(), ids, gl, ge, logits=logits16)
        for got, exp in zip((h.grad, w.grad), want32[:2], strict=True):  # bf16 operands, not the stored float32 ones
            assert (got.double() - exp).abs().max() > 1e-4 * exp.abs().max()


def test_grad_accumulation_float32_rounds_dw_once_input_per_chunk(monkeypatch):
    n, hs, v = 256, 32, 64
    h, w, b, ids = make(n, hs, v, torch.bfloat16, seed=3)
    gl = torch.randn(n, generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(native_mod, "_CHUNK_BYTES", 4 * v * 4)  # 4 rows per chunk: 64 chunks
    logits = torch.cat([torch.addmm(b, h[r:r + 4], w.t()) for r in range(0, n, 4)])
    _, _, want = ref_grads(h, w, b, ids, gl.double(), torch.zeros(n, dtype=torch.float64), logits=logits)
    errs = {}
    for mode in ("float32", "input"):
        hh, ww, bb = leaves(h, w, b)
        lp = rlkernel.linear_logp(hh, ww, ids, bias=bb, backend="native", grad_accumulation=mode)
        (gl * lp).sum().backward()
        assert ww.grad.dtype == torch.bfloat16 and bb.grad.dtype == torch.bfloat16
        errs[mode] = (ww.grad.double() - want[1]).abs().mean().item()
        if mode == "float32":  # one rounding of a float32 sum: within one bf16 unit of each element
            err = (ww.grad.double() - want[1]).abs()
            assert (err <= 2.0 ** -8 * want[1].abs() + 1e-5 * want[1].abs().max()).all()
    assert errs["input"] > 2 * errs["float32"], errs  # 64 roundings of a running bf16 sum


@pytest.mark.parametrize("mask_device", ["cpu"])
def test_mask_rows_give_zero_and_no_gradient(mask_device):
    n, hs, v = 20, 16, 40
    h, w, b, ids = make(n, hs, v, torch.float64, seed=7)
    mask = torch.rand(n, generator=torch.Generator().manual_seed(2)) > 0.5
    mask[0], mask[1] = True, False
    gl, ge = torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    hh, ww, bb = leaves(h, w, b)
    lp, ent = run(hh, ww, bb, ids, gl.float(), ge.float(), mask=mask)
    kept_ids = torch.where(mask, ids, IGNORE)
    want_lp, want_ent, want = ref_grads(h, w, b, kept_ids, gl, ge)
    close(lp, want_lp, 1e-6)
    close(ent, want_ent, 1e-6)
    assert (lp[~mask] == 0).all() and (ent[~mask] == 0).all()
    assert (hh.grad[~mask] == 0).all()
    for got, exp in zip((hh.grad, ww.grad, bb.grad), want, strict=True):
        close(got, exp, 1e-6)


def test_mask_compacts_rows_before_the_gemm(monkeypatch):
    """The op sees only the kept rows: the native forward's chunk matmul gets k rows, not n."""
    n, hs, v = 30, 8, 12
    h, w, b, ids = make(n, hs, v, seed=1)
    mask = torch.zeros(n, dtype=torch.bool)
    mask[::3] = True
    seen = []
    real = native_mod._matmul
    monkeypatch.setattr(native_mod, "_matmul", lambda hc, *a, **k: seen.append(hc.shape[0]) or real(hc, *a, **k))
    before = row_mask.host_syncs
    out = rlkernel.linear_logp(h, w, ids, bias=b, mask=mask, backend="native")
    assert seen == [int(mask.sum())]
    assert row_mask.host_syncs == before  # a CPU mask: no count read back
    full = rlkernel.linear_logp(h.double(), w.double(), ids, bias=b.double(), backend="native")
    torch.testing.assert_close(out[mask], full[mask], atol=1e-5, rtol=0)


def test_mask_arguments():
    h, w, b, ids = make(4, 8, 10)
    with pytest.raises(ValueError, match="mask shape"):
        rlkernel.linear_logp(h, w, ids, mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask must be None or a bool"):
        rlkernel.linear_logp(h, w, ids, mask=torch.ones(4))
    out = rlkernel.linear_logp(h, w, ids, mask=torch.zeros(4, dtype=torch.bool))  # nothing kept
    assert out.shape == (4,) and (out == 0).all()


def test_loss_mixed_precision_mask_and_accumulation_match_float64():
    n, hs, v = 40, 16, 50
    h32, w32, b32, ids = make(n, hs, v, seed=11)
    adv = torch.randn(n, generator=torch.Generator().manual_seed(4))
    mask = torch.ones(n, dtype=torch.bool)
    mask[5:15] = False
    seen = []

    def loss_fn(logp, entropy, sl):
        seen.append(sl)
        return -logp * adv[sl] - 0.1 * entropy

    h, w, b = leaves(h32.bfloat16(), w32, b32)
    loss = rlkernel.linear_logp_loss(h, w, ids, loss_fn, bias=b, chunk_size=8, backend="native", mask=mask,
                                     reduction="mean")
    loss.backward()
    assert (h.grad.dtype, w.grad.dtype, b.grad.dtype) == (torch.bfloat16, torch.float32, torch.float32)
    assert all(isinstance(sl, torch.Tensor) and sl.dtype == torch.int64 for sl in seen)
    assert sorted(torch.cat(seen).tolist()) == mask.nonzero().squeeze(1).tolist()
    h16, w16, b16 = h32.bfloat16(), w32.bfloat16(), b32.bfloat16()
    kept = mask & (ids != IGNORE)
    count = kept.sum().item()
    gl = torch.where(kept, -adv.double() / count, 0.0)
    ge = torch.where(kept, torch.full((n,), -0.1 / count, dtype=torch.float64), 0.0)
    want_lp, want_ent, want = ref_grads(h16, w16, b16, torch.where(mask, ids, IGNORE), gl, ge,
                                        logits=torch.addmm(b16, h16, w16.t()))
    want_loss = (gl * want_lp + ge * want_ent).sum()
    assert abs(loss.item() - want_loss.item()) <= 1e-5 * (1 + abs(want_loss.item()))
    assert (h.grad[~mask] == 0).all()
    close(h.grad, want[0], 2.0 ** -8 + 1e-5)
    # the chunk's autograd runs bf16 GEMMs (G in bf16, each chunk's product rounded), summed in float32 over 5 chunks
    close(w.grad, want[1], 4 * 2.0 ** -8)
    close(b.grad, want[2], 4 * 2.0 ** -8)


def test_loss_under_autocast_runs_loss_fn_under_autocast():
    h, w, b, ids = make(12, 8, 20, seed=2)
    dtypes = []

    def loss_fn(logp, entropy, sl):
        dtypes.append(torch.is_autocast_enabled("cpu"))
        return -logp

    hh, ww = leaves(h, w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = rlkernel.linear_logp_loss(hh, ww, ids, loss_fn, backend="native")
    loss.backward()
    assert dtypes == [True] and ww.grad.dtype == torch.float32
    ref = rlkernel.linear_logp_loss(h.bfloat16(), w.bfloat16(), ids, loss_fn, backend="native")
    assert torch.equal(loss, ref)  # the bf16 GEMMs
