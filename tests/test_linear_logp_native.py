"""rlkernel.linear_logp on its native backend (CPU): float64 references, gradcheck, argument checks, dispatch records.

Tolerances (native vs a float64 reference computed from the same rounded inputs):
- the logits are the matmul's result in the inputs' dtype, so each carries that dtype's rounding, at most one unit
  roundoff u of |x| (u = 2^-8 bf16, 2^-11 fp16; for float32, 1e-6, a float32 sum of <= 64 products):
  log_softmax moves by at most 2 max|dx| / T, so atol = 2 u max|x| / T plus 1e-5 for the float32 softmax;
- entropy: |dH| <= 2 max|dx| (1 + max|log p|) / T, bounded here by the same atol times (1 + log V + 2 max|x| / T);
- gradients, against a reference whose logits are rounded to the dtype as the op rounds them (float32 compute,
  cast to the dtype on the way out): 4 u of the largest gradient element (the output rounding, doubled, plus the
  rare logit that the float32-accumulated matmul rounds the other way).
"""
from __future__ import annotations

import math

import pytest
import torch

import rlkernel
from rlkernel import dispatch
from rlkernel.ops.native import linear_logp as native_mod
from rlkernel.ops.native.linear_logp import linear_logp_native

IGNORE = -100
UNIT = {torch.float32: 1e-6, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float64: 1e-15}


def make_inputs(lead, h, v, dtype, *, scale=1.0, bias=True, strided=False, seed=0, shift=0.0):
    """Fresh random hidden states [*lead, h], weight [v, h], bias [v], ids with one ignored row (when > 2 rows).
    strided: hidden is every other column of a wider buffer (a non-contiguous last dim view collapsed by reshape)."""
    g = torch.Generator().manual_seed(seed)
    width = 2 * h if strided else h
    base = torch.randn(*lead, width, generator=g, dtype=torch.float64)
    hidden = (base[..., ::2] if strided else base).to(dtype)
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64) * scale / math.sqrt(h)).to(dtype)
    b = (torch.randn(v, generator=g, dtype=torch.float64) * scale * 0.5 + shift).to(dtype) if bias else None
    ids = torch.randint(0, v, tuple(lead), generator=g)
    if ids.numel() > 2:
        ids.view(-1)[1] = IGNORE
    return hidden, weight, b, ids


def reference(hidden, weight, bias, ids, temperature, round_to=None):
    """float64 (logp, entropy, logits) from the inputs as given. ``round_to``: round the logits to that dtype as the
    op does (the gradient passes straight through the rounding)."""
    x = hidden.double() @ weight.double().t()
    if bias is not None:
        x = x + bias.double()
    if round_to is not None:
        x = x + (x.detach().to(round_to).double() - x.detach())
    z = x / temperature
    logp_all = torch.log_softmax(z, -1)
    valid = ids != IGNORE
    safe = torch.where(valid, ids, 0)
    lp = torch.where(valid, logp_all.gather(-1, safe.unsqueeze(-1)).squeeze(-1), 0.0)
    p = logp_all.exp()
    ent = torch.where(valid, -(p * logp_all).sum(-1), 0.0)
    return lp, ent, x


def tolerance(dtype, x, temperature, vocab):
    dx = UNIT[dtype] * float(x.abs().max())
    atol = 2 * dx / temperature + 1e-5
    return atol, atol * (1 + math.log(vocab) + 2 * float(x.abs().max()) / temperature)


CASES = [  # (lead, H, V, dtype, T, strided, bias, scale)
    ((5,), 33, 101, torch.float32, 1.0, False, True, 3.0),
    ((2, 7), 17, 4095, torch.float32, 0.7, True, False, 3.0),
    ((3, 3), 64, 4096, torch.bfloat16, 1.3, False, True, 3.0),
    ((9,), 31, 999, torch.float16, 0.9, True, True, 3.0),
    ((4,), 7, 1, torch.float32, 1.0, False, True, 1.0),
]


@pytest.mark.parametrize("lead,h,v,dtype,temperature,strided,bias,scale", CASES)
def test_forward_matches_float64(monkeypatch, lead, h, v, dtype, temperature, strided, bias, scale):
    monkeypatch.setattr(native_mod, "_CHUNK_BYTES", 4 * 4 * max(v, 1))  # 4 rows per chunk: several chunks
    hidden, weight, b, ids = make_inputs(lead, h, v, dtype, scale=scale, bias=bias, strided=strided, seed=v + h)
    lp, ent = rlkernel.linear_logp(hidden, weight, ids, bias=b, temperature=temperature, return_entropy=True,
                                   backend="native")
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == ids.shape
    ref_lp, ref_ent, x = reference(hidden, weight, b, ids, temperature)
    atol, atol_ent = tolerance(dtype, x, temperature, v)
    torch.testing.assert_close(lp.double(), ref_lp, atol=atol, rtol=1e-6)
    torch.testing.assert_close(ent.double(), ref_ent, atol=atol_ent, rtol=1e-6)
    ignored = ids == IGNORE
    assert torch.all(lp[ignored] == 0) and torch.all(ent[ignored] == 0)
    assert torch.all(lp[~ignored] <= 0)  # a log-prob is never positive (verl #2656)


@pytest.mark.parametrize("shift,scale", [(-3e3, 1.0), (0.0, 3e3)], ids=["all-negative", "extreme"])
def test_all_negative_and_extreme_finite_logits(shift, scale):
    # all-negative: every logit near -3000 (a max identity of 0 would underflow every exp, verl PR #7439);
    # extreme: logits up to ~1e4 in magnitude, still finite
    hidden, weight, b, ids = make_inputs((6,), 16, 301, torch.float32, scale=scale, shift=shift, seed=3)
    lp, ent = rlkernel.linear_logp(hidden, weight, ids, bias=b, return_entropy=True, backend="native")
    ref_lp, ref_ent, x = reference(hidden, weight, b, ids, 1.0)
    if shift:
        assert float(x.max()) < -2000
    atol, atol_ent = tolerance(torch.float32, x, 1.0, 301)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    torch.testing.assert_close(lp.double(), ref_lp, atol=atol, rtol=1e-6)
    torch.testing.assert_close(ent.double(), ref_ent, atol=atol_ent, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_match_float64(monkeypatch, dtype):
    monkeypatch.setattr(native_mod, "_CHUNK_BYTES", 4 * 4 * 257)
    hidden, weight, b, ids = make_inputs((3, 4), 24, 257, dtype, scale=3.0, seed=11)
    t = 0.8
    leaves = [a.detach().clone().requires_grad_(True) for a in (hidden, weight, b)]
    lp, ent = rlkernel.linear_logp(*leaves[:2], ids, bias=leaves[2], temperature=t, return_entropy=True,
                                   backend="native")
    g = torch.Generator().manual_seed(5)
    gl, gh = torch.randn(ids.shape, generator=g), torch.randn(ids.shape, generator=g)
    torch.autograd.backward([lp, ent], [gl, gh])
    refs = [a.detach().double().requires_grad_(True) for a in (hidden, weight, b)]
    rlp, rent, _ = reference(*refs[:2], refs[2], ids, t, round_to=dtype)
    torch.autograd.backward([rlp, rent], [gl.double(), gh.double()])
    for got, want, name in zip(leaves, refs, ("hidden", "weight", "bias"), strict=True):
        atol = 4 * UNIT[dtype] * float(want.grad.abs().max()) + 1e-6
        torch.testing.assert_close(got.grad.double(), want.grad, atol=atol, rtol=0, msg=name)
    # ignored rows pass no gradient to their hidden state
    assert torch.all(leaves[0].grad[ids == IGNORE] == 0)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_gradcheck_float64(monkeypatch, batch_invariant):
    monkeypatch.setattr(native_mod, "_CHUNK_BYTES", 4 * 2 * 53)  # 2 rows per chunk
    monkeypatch.setattr(native_mod, "BI_ROWS", 4)
    hidden, weight, b, ids = make_inputs((5,), 6, 53, torch.float64, scale=2.0, seed=2)
    args = [a.requires_grad_(True) for a in (hidden, weight, b)]

    def f(h, w, bias):
        return linear_logp_native(h, w, ids, bias=bias, temperature=0.7, ignore_index=IGNORE, return_entropy=True,
                                  batch_invariant=batch_invariant, keep_dtype=True)

    assert torch.autograd.gradcheck(f, args)


def test_batch_invariant_rows_are_bitwise_the_same_whatever_n_and_position(monkeypatch):
    """Row 5 alone and inside batches of other sizes and offsets: logp, entropy and its hidden gradient, same bits."""
    monkeypatch.setattr(native_mod, "BI_ROWS", 8)
    hidden, weight, b, ids = make_inputs((40,), 32, 777, torch.float32, scale=3.0, seed=9)

    def run(lo, hi):
        x = hidden[lo:hi].clone().requires_grad_(True)
        lp, ent = rlkernel.linear_logp(x, weight, ids[lo:hi], bias=b, return_entropy=True, batch_invariant=True,
                                       backend="native")
        (0.7 * lp.sum() + 0.3 * ent.sum()).backward()
        return lp[5 - lo:6 - lo], ent[5 - lo:6 - lo], x.grad[5 - lo:6 - lo]

    want = run(5, 6)
    for lo, hi in ((0, 40), (5, 13), (1, 6), (3, 20)):
        got = run(lo, hi)
        assert all(torch.equal(a, w) for a, w in zip(got, want, strict=True)), (lo, hi)


def test_argument_checks_raise_before_any_record():
    hidden, weight, b, ids = make_inputs((2, 3), 8, 11, torch.float32, seed=1)
    cases = [
        (dict(hidden=hidden.tolist()), TypeError, "hidden must be a torch.Tensor"),
        (dict(hidden=hidden.long()), TypeError, "hidden must be a floating-point"),
        (dict(weight=weight.t()), ValueError, "H = hidden.shape"),
        (dict(weight=weight[None]), ValueError, r"weight must be \[V, H\]"),
        (dict(weight=weight.bfloat16(), bias=b.half()), TypeError, "mixed bfloat16 and float16"),
        (dict(weight=weight[:0]), ValueError, "vocabulary of size 0"),
        (dict(bias=b[:-1]), ValueError, "bias shape"),
        (dict(grad_accumulation="float16"), ValueError, "grad_accumulation"),
        (dict(mask=ids), TypeError, "mask must be None or a bool"),
        (dict(bias=b.long()), TypeError, "bias must be a floating-point"),
        (dict(token_ids=ids.float()), TypeError, "token_ids must be an integer"),
        (dict(token_ids=ids[:1]), ValueError, "token_ids shape"),
        (dict(temperature=-1.0), ValueError, "temperature"),  # T = 0: the processed (greedy) mode
        (dict(temperature=float("nan")), ValueError, "temperature"),
        (dict(temperature=float("inf")), ValueError, "temperature"),
        (dict(temperature="1"), TypeError, "temperature"),
        (dict(ignore_index=1.5), TypeError, "ignore_index"),
        (dict(batch_invariant=1), TypeError, "batch_invariant"),
        (dict(backend="cuda"), ValueError, "backend"),
    ]
    for change, exc, match in cases:
        kw = dict(hidden=hidden, weight=weight, token_ids=ids, bias=b)
        kw.update(change)
        pos = [kw.pop("hidden"), kw.pop("weight"), kw.pop("token_ids")]
        with dispatch.recording() as rec, pytest.raises(exc, match=match):
            rlkernel.linear_logp(*pos, **kw)
        assert not [r for r, _ in rec.records if r.status != "blocked"], change


def test_bad_id_on_cpu_raises_index_error_naming_the_position():
    hidden, weight, b, ids = make_inputs((2, 3), 8, 11, torch.float32, seed=1)
    ids[1, 2] = 11
    with dispatch.recording() as rec, pytest.raises(IndexError, match=r"linear_logp.forward: token id out of range "
                                                                      r"at position \(1, 2\) \(id 11, vocab size 11\)"):
        rlkernel.linear_logp(hidden, weight, ids, bias=b)
    assert rec.records == []
    ids[1, 2] = -5  # negative and not ignore_index
    with pytest.raises(IndexError, match="id -5"):
        rlkernel.linear_logp(hidden, weight, ids)


def test_dispatch_records_and_fallback_on_cpu():
    hidden, weight, b, ids = make_inputs((4,), 8, 13, torch.float32, seed=4)
    hidden.requires_grad_(True)
    with dispatch.recording() as rec:
        rlkernel.linear_logp(hidden, weight, ids, backend="native").sum().backward()
    assert {(r.op, r.status) for r, _ in rec.records} == {("linear_logp.forward", "native"),
                                                          ("linear_logp.backward", "native")}
    with dispatch.recording() as rec:
        rlkernel.linear_logp(hidden, weight, ids).sum().backward()  # auto on CPU: a recorded fallback
    assert rec.statuses() == {"fallback"}
    assert {r.reason for r, _ in rec.records} == {"tensor on cpu"}
    with pytest.raises(rlkernel.FusedKernelUnavailable, match="linear_logp.forward"):
        rlkernel.linear_logp(hidden, weight, ids, backend="fused")
    with pytest.raises(rlkernel.FusedKernelUnavailable):
        rlkernel.linear_logp(hidden, weight, ids, require_fused=True)


def test_ignored_rows_give_zero_and_no_weight_gradient():
    hidden, weight, b, ids = make_inputs((6,), 8, 29, torch.float32, seed=6)
    ids[:] = IGNORE
    ids[2] = 3
    w = weight.clone().requires_grad_(True)
    lp = rlkernel.linear_logp(hidden, w, ids, backend="native")
    assert torch.all(lp[ids == IGNORE] == 0)
    lp.sum().backward()
    w_one = weight.clone().requires_grad_(True)
    rlkernel.linear_logp(hidden[2:3], w_one, ids[2:3], backend="native").sum().backward()
    torch.testing.assert_close(w.grad, w_one.grad, atol=1e-6, rtol=1e-6)


def test_empty_input_gives_empty_output():
    hidden, weight, b, ids = make_inputs((0,), 8, 13, torch.float32)
    lp, ent = rlkernel.linear_logp(hidden, weight, ids, bias=b, return_entropy=True, backend="native")
    assert lp.shape == ent.shape == (0,)
