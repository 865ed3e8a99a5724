"""Combinations of linear_logp's merged features (mixed precision, mask, per-row temperature, options, processed
mode) against a float64 reference computed by hand: the cases the op-precision / processed-linear merges broke."""
import pytest
import torch

from rlkernel import linear_logp, linear_logp_loss

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


def _top_k_reference(hidden, weight, bias, ids, k, compute):
    """The processed (top-k) log-probs by hand in float64 from operands rounded to the compute dtype, and the
    gradients of their sum with the kept set held fixed."""
    h, w, b = (t.detach().to(compute).double().requires_grad_() for t in (hidden, weight, bias))
    z = h @ w.t() + b
    kept = torch.zeros_like(z, dtype=torch.bool).scatter_(-1, z.detach().topk(k, -1).indices, True)
    lse = torch.logsumexp(torch.where(kept, z, -torch.inf), -1)
    lp = z.gather(-1, ids[:, None]).squeeze(-1) - lse
    on = kept.gather(-1, ids[:, None]).squeeze(-1)
    grads = torch.autograd.grad(torch.where(on, lp, 0.0).sum(), (h, w, b))
    return torch.where(on, lp, -torch.inf).detach(), on, grads


@pytest.mark.parametrize("hidden_dtype,weight_dtype", [(torch.float32, torch.float64), (torch.float64, torch.float32)])
def test_processed_mode_with_mixed_dtypes(hidden_dtype, weight_dtype):
    # the processed mode ran hidden @ weight.T on the stored dtypes: mixed dtypes (allowed by the merged checks,
    # the contract's "both ops, both paths") were a matmul dtype error; now the GEMMs run in the compute dtype
    hidden, weight, ids = _inputs(hidden_dtype, weight_dtype)
    bias = (torch.randn(V, generator=torch.Generator().manual_seed(2)) * 0.1).to(weight_dtype).requires_grad_()
    lp = linear_logp(hidden, weight, ids, bias=bias, top_k=5, backend="native")
    ref, on, (ref_dh, ref_dw, ref_db) = _top_k_reference(hidden, weight, bias, ids, 5, torch.float32)
    assert on.any() and (~on).any()
    assert torch.equal(lp.isinf(), ~on)
    assert (lp[on].double() - ref[on]).abs().max() < 1e-5
    dh, dw, db = torch.autograd.grad(torch.where(on, lp, 0.0).sum(), (hidden, weight, bias))
    assert (dh.dtype, dw.dtype, db.dtype) == (hidden_dtype, weight_dtype, weight_dtype)
    for got, want in ((dh, ref_dh), (dw, ref_dw), (db, ref_db)):
        assert (got.double() - want).abs().max() < 1e-4


def test_processed_loss_with_bf16_hidden_and_float32_weight():
    hidden, weight, ids = _inputs(torch.bfloat16, torch.float32)
    bias = torch.zeros(V, requires_grad=True)
    loss = linear_logp_loss(hidden, weight, ids, lambda lp, ent, sl: -torch.where(lp.isinf(), 0.0, lp), bias=bias,
                            top_k=5, backend="native")
    ref, on, _ = _top_k_reference(hidden, weight, bias, ids, 5, torch.bfloat16)
    assert abs(loss.item() + ref[on].sum().item()) < 0.05 * ref[on].abs().sum().item()
    dh, dw = torch.autograd.grad(loss, (hidden, weight))
    assert dh.dtype == torch.bfloat16 and dw.dtype == torch.float32


@pytest.mark.parametrize("op", ["linear_logp", "linear_logp_loss"])
def test_processed_mode_refuses_a_bad_grad_accumulation(op):
    # the processed branch returned before grad_accumulation was checked: any value was silently accepted
    hidden, weight, ids = _inputs(torch.float32, torch.float32)
    with pytest.raises(ValueError, match="grad_accumulation"):
        if op == "linear_logp":
            linear_logp(hidden, weight, ids, top_k=5, grad_accumulation="bf16", backend="native")
        else:
            linear_logp_loss(hidden, weight, ids, lambda lp, ent, sl: lp, top_k=5, grad_accumulation="bf16",
                             backend="native")


def test_processed_mode_gathers_a_dtensor_weight():
    # the processed branch returned before sharded.full: a DTensor (FSDP2) weight met plain hidden states in the
    # GEMM ("mixed torch.Tensor and DTensor"); one CPU rank over gloo, no port (HashStore)
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("torch.distributed unavailable or already initialised")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        hidden, weight, ids = _inputs(torch.float32, torch.float32)
        sharded = torch.nn.Parameter(distribute_tensor(weight.detach(), init_device_mesh("cpu", (1,)), [Shard(0)]))
        lp = linear_logp(hidden, sharded, ids, top_k=5, backend="native")
        ref = linear_logp(hidden, weight, ids, top_k=5, backend="native")
        assert torch.equal(lp, ref)
        on = ~ref.isinf()
        torch.where(on, lp, 0.0).sum().backward()
        (dw,) = torch.autograd.grad(torch.where(on, ref, 0.0).sum(), (weight,))
        assert torch.equal(sharded.grad.full_tensor(), dw)
    finally:
        dist.destroy_process_group()


def _masked_call(op, temperature, mask):
    hidden, weight, ids = _inputs(torch.float32, torch.float32)
    hidden, ids = hidden.detach().view(2, 5, H), ids.view(2, 5)
    if op == "linear_logp":
        return linear_logp(hidden, weight, ids, temperature=temperature, mask=mask, backend="native")
    return linear_logp_loss(hidden, weight, ids, lambda lp, ent, sl: -lp, temperature=temperature, mask=mask,
                            backend="native")


@pytest.mark.parametrize("op", ["linear_logp", "linear_logp_loss"])
def test_masked_call_names_a_bad_temperature_by_its_own_row(op):
    # the temperature was checked after the compaction: the error named the row among the kept rows (1 here)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[0, :2] = False
    temperature = torch.ones(2, 5)
    temperature[0, 3] = -1.0
    with pytest.raises(ValueError, match="temperature of row 3 "):
        _masked_call(op, temperature, mask)


@pytest.mark.parametrize("op", ["linear_logp", "linear_logp_loss"])
def test_masked_call_checks_the_temperature_as_an_unmasked_one(op):
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 3:] = False
    # a [B, 1] temperature is refused without a mask; the mask's expand() accepted it
    with pytest.raises(ValueError, match="shape"):
        _masked_call(op, torch.ones(2, 1), mask)
    # a bad value on a masked row is refused, as on an ignored row (it was skipped unchecked)
    temperature = torch.ones(2, 5)
    temperature[1, 4] = 0.0
    with pytest.raises(ValueError, match="temperature of row 9 "):
        _masked_call(op, temperature, mask)


def test_mask_with_per_row_temperature_matches_float64_reference():
    hidden, weight, ids = _inputs(torch.float32, torch.float32)
    temperature = torch.rand(10, generator=torch.Generator().manual_seed(1)) + 0.5
    keep = torch.tensor([True, False, True, True, False, True, True, True, False, True])
    lp, ent = linear_logp(hidden, weight, ids, temperature=temperature, mask=keep, return_entropy=True,
                          backend="native")
    ref, (ref_dh, ref_dw) = _reference(hidden, weight, ids, temperature, torch.float32, keep)
    assert (lp.double() - ref).abs().max() < 1e-5 and not ent[~keep].any() and ent[keep].gt(0).all()
    dh, dw = torch.autograd.grad(lp.sum(), (hidden, weight))
    assert (dh.double() - ref_dh).abs().max() < 1e-4 and (dw.double() - ref_dw).abs().max() < 1e-4


def test_processed_mode_under_autocast_backward_recomputes_in_the_forward_dtype():
    # the processed backward recomputes the logits (and the kept set) from the saved inputs: under autocast the
    # forward ran its GEMM in bf16 but the backward (after the autocast block) in float32, a silently different
    # gradient. Cast to the compute dtype up front, it is the bf16 call's gradient exactly
    hidden, weight, ids = _inputs(torch.float32, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp = linear_logp(hidden, weight, ids, top_p=0.8, backend="native")
    on = ~lp.isinf()
    got = torch.autograd.grad(torch.where(on, lp, 0.0).sum(), (hidden, weight))
    want_lp = linear_logp(hidden.to(torch.bfloat16), weight.to(torch.bfloat16), ids, top_p=0.8, backend="native")
    want = torch.autograd.grad(torch.where(on, want_lp, 0.0).sum(), (hidden, weight))
    assert torch.equal(lp, want_lp)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
