"""rlkernel.linear_logp_loss against a float64 reference of the unfused loss (the N x V logits materialised), with a
GRPO/PPO clipped objective and an entropy bonus as loss_fn: the loss and the gradients of hidden, weight and bias.
The native backend runs everywhere (CPU in CI); the fused one on CUDA (skipped without it).

Tolerances. The op's logits are the GEMM's result in the inputs' dtype (as ``hidden @ weight.T`` gives them), so the
reference rounds its float64 logits to that dtype too; what remains is
- float32: float32 accumulation in the GEMMs and the softmax: loss 1e-5 relative, gradients 1e-4 of their largest
  entry (the log-softmax of V <= 1000 terms and two more GEMMs over H <= 70 / N <= 130 terms, ~1e-6 each, x10 margin);
- bfloat16: a logit whose float32 accumulation lands across a rounding boundary from the float64 one flips by one ulp
  (2^-8 relative, |z| < 16 here: <= 0.06 nats for that one logit, and p <= 1 of it moves logp) in a few tokens; the
  logits' gradient is rounded to bfloat16 (2^-9) before the dH/dW GEMMs, whose outputs round again (2^-9), and dW is
  rounded once more per chunk it is accumulated over (fused path, weight's dtype). Loss: 2e-3 of (1 + |loss|);
  gradients: (chunks + 4) * 2^-8 of their largest entry.
"""
from __future__ import annotations

import math

import pytest
import torch

import rlkernel
from rlkernel import dispatch, errors
from rlkernel.ops import linear_logp_loss as mod

IGNORE = -100
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


def make(lead, h, v, dtype, device, *, seed=0, bias=True, ignore=True):
    """Fresh random inputs (never zeros); rows 1 and N-1 ignored."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(lead)
    hid = torch.randn(*lead, h, generator=g)
    w = torch.randn(v, h, generator=g) * (2.0 / math.sqrt(h))
    b = torch.randn(v, generator=g) if bias else None
    ids = torch.randint(0, v, lead, generator=g)
    if ignore and n >= 3:
        ids.view(-1)[1] = IGNORE
        ids.view(-1)[n - 1] = IGNORE
    adv = torch.randn(n, generator=g)
    noise = torch.randn(n, generator=g) * 0.3

    def dev(t):
        return None if t is None else t.to(device=device, dtype=dtype)

    return dev(hid), dev(w), dev(b), ids.to(device), adv.to(device), noise.to(device)


def grpo(adv, old, eps=0.2, beta=0.01):
    """A GRPO/PPO clipped objective with an entropy bonus, per token, indexing its inputs by the chunk's slice."""
    def loss_fn(lp, ent, sl):
        ratio = torch.exp(lp - old[sl].to(lp.dtype))
        a = adv[sl].to(lp.dtype)
        return -torch.minimum(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a) - beta * ent
    return loss_fn


def reference(hid, w, b, ids, adv, noise, temperature, reduction):
    """float64 loss and gradients from materialised logits (rounded to the inputs' dtype, as the op's GEMM gives
    them), plus the old log-probs (reference logp + noise) the objective uses."""
    h64 = hid.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_() if b is not None else None
    z = h64 @ w64.T + (b64 if b64 is not None else 0)
    if hid.dtype != torch.float64:
        z = z.to(hid.dtype).double()  # the cast's backward passes the gradient through
    la = torch.log_softmax(z / temperature, -1).reshape(-1, w.shape[0])
    keep = (ids != IGNORE).reshape(-1)
    safe = torch.where(keep, ids.reshape(-1), 0)
    lp = torch.where(keep, la.gather(1, safe[:, None])[:, 0], 0.0)
    ent = torch.where(keep, -(la.exp() * la).sum(-1), 0.0)
    old = (lp.detach() + noise.double()).float()
    per = grpo(adv.double(), old.double())(lp, ent, slice(None))
    loss = torch.where(keep, per, 0.0).sum()
    if reduction == "mean":
        loss = loss / keep.sum().clamp_min(1)
    loss.backward()
    return loss.detach(), old, (h64.grad, w64.grad, b64.grad if b64 is not None else None)


def tolerances(dtype, chunks):
    if dtype == torch.bfloat16:
        return 2e-3, (chunks + 4) * 2.0 ** -8
    return 1e-5, 1e-4


def strided_view(x):
    """x's values in a strided, differentiable view: rows of a wider buffer, from column 1 (row stride H + 3)."""
    h = x.shape[-1]
    return torch.nn.functional.pad(x, (1, 2))[..., 1:h + 1]


def check(hid, w, b, ids, adv, noise, *, temperature, reduction, chunk_size, backend, strided=False):
    ref_loss, old, ref_grads = reference(hid, w, b, ids, adv, noise, temperature, reduction)
    leaves = [t.detach().clone().requires_grad_() for t in (hid, w)] + \
        ([b.detach().clone().requires_grad_()] if b is not None else [])
    h_, w_ = leaves[:2]
    b_ = leaves[2] if b is not None else None
    h_in = strided_view(h_) if strided else h_
    assert h_in.is_contiguous() != strided
    loss = rlkernel.linear_logp_loss(h_in, w_, ids, grpo(adv, old.to(hid.device)), bias=b_, temperature=temperature,
                                     reduction=reduction, chunk_size=chunk_size, backend=backend)
    loss.backward()
    n = ids.numel()
    chunks = math.ceil(n / chunk_size) if chunk_size else 1
    tol_loss, tol_grad = tolerances(hid.dtype, chunks)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert abs(loss.item() - ref_loss.item()) <= tol_loss * (1 + abs(ref_loss.item())), (loss.item(), ref_loss.item())
    for name, got, want in zip(("hidden", "weight", "bias"), (h_.grad, w_.grad, b_.grad if b_ is not None else None),
                               ref_grads, strict=True):
        if want is None:
            continue
        assert got.dtype == hid.dtype and got.shape == want.shape, name
        err = (got.double().cpu() - want.cpu()).abs().max().item()
        scale = want.abs().max().item()
        assert err <= tol_grad * scale + 1e-12, (name, err, scale)
    return h_.grad


CASES = [  # (lead, H, V, chunk_size, temperature, reduction, bias, strided)
    ((7, 9), 33, 257, 16, 1.0, "sum", True, False),
    ((61,), 64, 1000, 7, 0.7, "mean", False, False),
    ((3, 43), 17, 129, None, 1.3, "mean", True, True),
    ((2, 5), 70, 511, 1, 0.9, "sum", False, True),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}v{c[2]}c{c[3]}")
def test_native_matches_float64_reference(dtype, case):
    lead, h, v, chunk, t, red, bias, strided = case
    inputs = make(lead, h, v, dtype, "cpu", seed=sum(lead) + v, bias=bias)
    with dispatch.recording() as rec:
        check(*inputs, temperature=t, reduction=red, chunk_size=chunk, backend="native", strided=strided)
    assert rec.records == [(dispatch.Dispatch("linear_logp_loss", "native", "native", "native"), 1)]


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}v{c[2]}c{c[3]}")
def test_fused_matches_float64_reference(dtype, case):
    lead, h, v, chunk, t, red, bias, strided = case
    inputs = make(lead, h, v, dtype, "cuda", seed=sum(lead) + v, bias=bias)
    with dispatch.recording() as rec:
        check(*inputs, temperature=t, reduction=red, chunk_size=chunk, backend="fused", strided=strided)
    assert rec.statuses("linear_logp_loss") == {"fused"}
    rlkernel.check_errors()


def test_native_gradients_match_finite_differences_float64():
    """The directional derivative of the loss along random directions, by central differences (float64), equals
    <gradient, direction> (gradcheck's check; gradcheck itself runs backward repeatedly, and this op's backward runs
    once: its gradients were computed in the forward)."""
    hid, w, b, ids, adv, noise = make((2, 3), 5, 11, torch.float64, "cpu", seed=3)
    fn = grpo(adv.double(), noise.double() - 2)

    def f(h_, w_, b_):
        return rlkernel.linear_logp_loss(h_, w_, ids, fn, bias=b_, temperature=0.8, chunk_size=4, backend="native",
                                         reduction="mean")

    args = [t.detach().clone().requires_grad_() for t in (hid, w, b)]
    f(*args).backward()
    g = torch.Generator().manual_seed(4)
    for i, leaf in enumerate(args):
        for _ in range(3):
            v = torch.randn(leaf.shape, generator=g, dtype=torch.float64)
            eps = 1e-6
            plus = [a.detach() + (eps * v if j == i else 0) for j, a in enumerate(args)]
            minus = [a.detach() - (eps * v if j == i else 0) for j, a in enumerate(args)]
            fd = (f(*plus) - f(*minus)).item() / (2 * eps)
            assert abs(fd - (leaf.grad * v).sum().item()) <= 1e-6 * (1 + abs(fd)), i


def test_chunking_does_not_change_the_result_and_ignored_rows_get_no_gradient():
    hid, w, b, ids, adv, noise = make((5, 11), 13, 97, torch.float64, "cpu", seed=5)
    old = torch.randn(55, dtype=torch.float64) - 3
    out = []
    for chunk in (1, 8, 55, 1000):
        h_, w_ = hid.clone().requires_grad_(), w.clone().requires_grad_()
        loss = rlkernel.linear_logp_loss(h_, w_, ids, grpo(adv.double(), old), chunk_size=chunk, backend="native")
        loss.backward()
        out.append((loss.detach(), h_.grad, w_.grad))
    for loss, gh, gw in out[1:]:
        torch.testing.assert_close(loss, out[0][0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gh, out[0][1], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(gw, out[0][2], rtol=1e-10, atol=1e-12)
    ignored = (ids == IGNORE)
    assert ignored.sum() == 2 and (out[0][1][ignored] == 0).all() and (out[0][1][~ignored] != 0).any()


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_every_row_ignored_gives_zero(reduction):
    hid, w, _, ids, adv, _ = make((4, 3), 6, 20, torch.float32, "cpu", seed=7, bias=False)
    ids = torch.full_like(ids, IGNORE)
    h_, w_ = hid.clone().requires_grad_(), w.clone().requires_grad_()
    loss = rlkernel.linear_logp_loss(h_, w_, ids, lambda lp, en, sl: 1.0 - lp * adv[sl], reduction=reduction,
                                     backend="native")
    loss.backward()
    assert loss.item() == 0.0 and (h_.grad == 0).all() and (w_.grad == 0).all()


def test_empty_input_and_loss_independent_of_logp():
    hid, w = torch.randn(0, 8, requires_grad=True), torch.randn(12, 8, requires_grad=True)
    loss = rlkernel.linear_logp_loss(hid, w, torch.zeros(0, dtype=torch.long), lambda lp, en, sl: lp,
                                     backend="native")
    loss.backward()
    assert loss.item() == 0.0 and hid.grad.shape == (0, 8) and (w.grad == 0).all()
    h2, w2 = torch.randn(3, 8, requires_grad=True), torch.randn(12, 8, requires_grad=True)
    loss = rlkernel.linear_logp_loss(h2, w2, torch.tensor([1, 2, 3]), lambda lp, en, sl: torch.ones_like(lp) * 2,
                                     backend="native")
    loss.backward()
    assert loss.item() == 6.0 and (h2.grad == 0).all() and (w2.grad == 0).all()


def test_backward_scales_by_the_incoming_gradient_once_and_only_needed_grads():
    hid, w, b, ids, adv, noise = make((4, 5), 9, 31, torch.float64, "cpu", seed=11)
    fn = grpo(adv.double(), noise.double() - 3)
    grads = []
    for k in (1.0, -2.5):
        h_, w_ = hid.clone().requires_grad_(), w.clone().requires_grad_()
        (k * rlkernel.linear_logp_loss(h_, w_, ids, fn, backend="native")).backward()
        grads.append((h_.grad, w_.grad))
    torch.testing.assert_close(grads[1][0], -2.5 * grads[0][0])
    torch.testing.assert_close(grads[1][1], -2.5 * grads[0][1])
    w_ = w.clone().requires_grad_()
    loss = rlkernel.linear_logp_loss(hid, w_, ids, fn, backend="native")
    loss.backward(retain_graph=True)
    torch.testing.assert_close(w_.grad, grads[0][1])
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()
    with torch.no_grad():  # no gradient wanted: the loss alone
        again = rlkernel.linear_logp_loss(hid, w_, ids, fn, backend="native")
    assert not again.requires_grad
    torch.testing.assert_close(again, loss.detach())


def test_bad_arguments_raise_before_any_work():
    hid, w, b, ids, adv, _ = make((2, 3), 4, 10, torch.float32, "cpu")
    fn = grpo(adv, adv)
    bad = [
        (dict(hidden=hid.long()), TypeError, "hidden"),
        (dict(weight=w.bfloat16(), bias=b.half()), TypeError, "mixed bfloat16 and float16"),
        (dict(weight=w[:, :3]), ValueError, "weight shape"),
        (dict(weight=w[None]), ValueError, r"weight must be \[V, H\]"),  # the checks linear_logp shares
        (dict(weight=w[:0]), ValueError, "vocabulary of size 0"),
        (dict(bias=b[:5]), ValueError, "bias shape"),
        (dict(grad_accumulation="float16"), ValueError, "grad_accumulation"),
        (dict(mask=ids), TypeError, "mask must be None or a bool"),
        (dict(token_ids=ids.float()), TypeError, "token_ids"),
        (dict(token_ids=ids[:1]), ValueError, "token_ids shape"),
        (dict(loss_fn=3), TypeError, "loss_fn"),
        (dict(temperature=-1.0), ValueError, "temperature"),  # T = 0: the processed (greedy) mode
        (dict(temperature="1"), TypeError, "temperature"),
        (dict(ignore_index=1.5), TypeError, "ignore_index"),
        (dict(reduction="max"), ValueError, "reduction"),
        (dict(chunk_size=0), ValueError, "chunk_size"),
        (dict(backend="cuda"), ValueError, "backend"),
    ]
    for change, exc, match in bad:
        kw = dict(hidden=hid, weight=w, token_ids=ids, loss_fn=fn, bias=b)
        kw.update(change)
        with dispatch.recording() as rec, pytest.raises(exc, match=match):
            rlkernel.linear_logp_loss(kw.pop("hidden"), kw.pop("weight"), kw.pop("token_ids"), kw.pop("loss_fn"),
                                      **kw)
        assert rec.records == [] or match == "backend", change
    ids2 = ids.clone()
    ids2[1, 2] = 10
    with dispatch.recording() as rec, pytest.raises(IndexError, match=r"linear_logp_loss: token id out of range at "
                                                                       r"position \(1, 2\) \(id 10, vocab size 10\)"):
        rlkernel.linear_logp_loss(hid, w, ids2, fn, backend="native")
    assert rec.records == []
    with pytest.raises(ValueError, match=r"loss_fn must return the chunk's per-token losses, shape \(2,\)"):
        rlkernel.linear_logp_loss(hid, w, ids, lambda lp, en, sl: lp.sum(), chunk_size=2, backend="native")
    with pytest.raises(dispatch.FusedKernelUnavailable, match="linear_logp_loss"):
        rlkernel.linear_logp_loss(hid, w, ids, fn, require_fused=True)


def test_default_chunk_holds_about_a_gib_of_logits():
    assert mod.default_chunk(16384, 128256, 2) == 4096
    assert mod.default_chunk(100, 128256, 2) == 100
    c = mod.default_chunk(10 ** 6, 151936, 2)
    assert c % 256 == 0 and c * 151936 * 2 <= mod.CHUNK_BYTES
    assert mod.default_chunk(5, 10 ** 12, 4) == 1


def test_error_record_names_positions_of_the_whole_call(monkeypatch):
    """A chunk's kernel reports positions within the chunk; errors.begin's offset turns them into the call's."""
    monkeypatch.setattr(errors, "_ring", [None] * errors.RING)
    errors._ring[21 % errors.RING] = (21, "linear_logp_loss", torch.Size([4, 6]), 50, 12)
    e = errors.describe((21 << 32) | 3, errors.ERR_LOGP_BAD_ID, 77)
    assert isinstance(e, IndexError)
    assert str(e) == ("linear_logp_loss: token id out of range at position (2, 3) (id 77, vocab size 50) "
                      "[call #21]")


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["native", "fused"])
def test_cuda_bad_id_goes_to_the_device_record(backend):
    hid, w, b, ids, adv, noise = make((3, 40), 16, 64, torch.bfloat16, "cuda", seed=2)
    rlkernel.check_errors()
    ids = ids.clone()
    ids[2, 7] = 64  # in the third chunk of 16 tokens
    h_ = hid.clone().requires_grad_()
    loss = rlkernel.linear_logp_loss(h_, w, ids, grpo(adv, noise - 3), bias=b, chunk_size=16, backend=backend)
    loss.backward()
    assert torch.isnan(loss).item()
    with pytest.raises(IndexError, match=r"linear_logp_loss: token id out of range at position \(2, 7\) \(id 64"):
        rlkernel.check_errors()


@needs_cuda
@pytest.mark.gpu
def test_fused_matches_native_on_cuda():
    hid, w, b, ids, adv, noise = make((8, 96), 128, 3001, torch.bfloat16, "cuda", seed=9)
    fn = grpo(adv, noise - 5)
    res = []
    for backend in ("native", "fused"):
        h_, w_ = hid.clone().requires_grad_(), w.clone().requires_grad_()
        loss = rlkernel.linear_logp_loss(h_, w_, ids, fn, temperature=0.9, chunk_size=256, backend=backend,
                                         reduction="mean")
        loss.backward()
        res.append((loss.item(), h_.grad.float(), w_.grad.float()))
    (l0, h0, w0), (l1, h1, w1) = res
    chunks = math.ceil(ids.numel() / 256)
    assert abs(l0 - l1) <= 2e-3 * (1 + abs(l0))
    assert (h0 - h1).abs().max() <= (chunks + 4) * 2.0 ** -8 * h0.abs().max()
    assert (w0 - w1).abs().max() <= (chunks + 4) * 2.0 ** -8 * w0.abs().max()
