"""GPU tests of the epilogue GEMM forward of rlkernel.linear_logp / linear_logp_loss (issue 37; skipped without CUDA,
and on GPUs other than compute capability 9.0, where the kernel refuses and the cuBLAS path runs).

The epilogue GEMM's logits are the float32 accumulator (+ the bias in float32) whatever ``logits_dtype`` says, so its
references are float64 of the exact product ``hidden @ weight.T + bias`` of the 16-bit inputs. ``make_dyadic`` draws
inputs whose products and sums are exact in float32 in any order (small multiples of powers of two), so there the
float32 GEMM adds no error and the kernels' own tolerances apply (tests/test_linear_logp_fused.py); a wrong column,
row or tile in the epilogue shows. The cuBLAS path's tests that do not depend on which GEMM made the logits (CUDA
graphs, the error record and no host sync, batch invariance, empty input, end to end vs the exact product and vs
native) run here again with the switch on, and every test checks that the epilogue GEMM ran
(``epilogue_gemm.records()``).
"""
from __future__ import annotations

import math

import pytest
import test_linear_logp_fused as base
import torch
from test_linear_logp_fused import IGNORE, UNIT, assert_within, make, reference

import rlkernel
from rlkernel import dispatch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def require_epilogue_build() -> None:
    """Skip on GPUs other than compute capability 9.0; fail where the extension or its CUTLASS build is missing."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the epilogue GEMM needs a compute capability 9.0 GPU")
    from rlkernel import _ext

    reason = _ext.unavailable_reason()
    if reason:
        pytest.fail(f"CUDA is available but rlkernel._C is not: {reason}")
    _ext.load()
    if not torch.ops.rlkernel.linear_logp_epilogue_built():
        pytest.fail("rlkernel._C was built without the CUTLASS headers (pip install nvidia-cutlass==4.2.0.0, rebuild)")


@pytest.fixture(params=[0, 1, 2], ids=["cooperative", "pingpong", "cluster2"])
def epi(request, monkeypatch):
    """The fused module with the epilogue GEMM switched on in each config (its records reset; float16 runs config
    0 either way); the switches restored after."""
    require_epilogue_build()
    from rlkernel.ops.fused import epilogue_gemm
    from rlkernel.ops.fused import linear_logp as linear_logp_fused

    monkeypatch.setattr(epilogue_gemm, "ENABLED", True)
    monkeypatch.setattr(epilogue_gemm, "CONFIG", request.param)
    epilogue_gemm.reset_records()
    rlkernel.check_errors()
    yield linear_logp_fused
    epilogue_gemm.reset_records()


def took_epilogue(only: bool = True) -> None:
    """The epilogue GEMM ran (only: and no forward of this test took the cuBLAS path)."""
    from rlkernel.ops.fused import epilogue_gemm

    rec = epilogue_gemm.records()
    assert rec.get(("epilogue", ""), 0) > 0, rec
    if only:
        assert all(kernel == "epilogue" for kernel, _ in rec), rec


def make_dyadic(n, h, v, dtype, *, bias=True, seed=0):
    """Inputs whose logits are exact in float32 whatever the order of the sum: hidden in {-1, -3/4, .., 1}, weight
    and bias small integers times 2^-s (s sets a logit's std near 3); at most log2(16 K) significant bits per
    partial sum. Ids as ``make`` (row 1 ignored when n > 2)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    s = max(0, round(math.log2(math.sqrt(h) * 1.7 / 3)))
    hidden = (torch.randint(-4, 5, (n, h), device="cuda", generator=g) / 4).to(dtype)
    weight = (torch.randint(-4, 5, (v, h), device="cuda", generator=g) * 2.0 ** -s).to(dtype)
    b = (torch.randint(-8, 9, (v,), device="cuda", generator=g) * 2.0 ** -s).to(dtype) if bias else None
    ids = torch.randint(0, v, (n,), device="cuda", generator=g)
    if n > 2:
        ids[1] = IGNORE
    return hidden, weight, b, ids


def exact_logits(hidden, weight, bias):
    return hidden.double() @ weight.double().t() + (bias.double() if bias is not None else 0.0)


def gemm_error(hidden, weight, bias, temperature):
    """Per row, the largest |dz| a float32 GEMM (+ bias) may put on z = x / T; and the exact float64 logits."""
    h64, w64 = hidden.double(), weight.double()
    exact = h64 @ w64.t() + (bias.double() if bias is not None else 0.0)
    k = hidden.shape[1]
    dx = 4 * k * 2.0 ** -24 * (h64.abs() @ w64.abs().t()) + 2.0 ** -23 * exact.abs()
    return exact, dx.max(-1).values / temperature


CASES = [  # (N, H, V, dtype, T, strided, bias, entropy, logits float32)
    (37, 64, 4096, torch.bfloat16, 1.0, False, False, True, False),
    (129, 136, 4095, torch.float16, 1.3, False, True, True, False),  # N, V, K off the 128 x 256 x 64 tile
    (300, 128, 2049, torch.bfloat16, 0.7, True, True, False, True),  # rows of stride 256 (a view), no entropy
    (64, 896, 1000, torch.bfloat16, 1.0, False, True, True, True),
    (1, 64, 300, torch.bfloat16, 0.9, False, True, True, False),  # one row, one partial tile of 44 columns
    (260, 256, 512, torch.float16, 1.0, False, False, True, True),  # V a whole number of tiles
]


@pytest.mark.parametrize("n,h,v,dtype,temperature,strided,bias,entropy,f32", CASES)
def test_forward_matches_float64_of_the_exact_product(epi, n, h, v, dtype, temperature, strided, bias, entropy, f32):
    hidden, weight, b, ids = make_dyadic(n, h, v, dtype, bias=bias, seed=n + v + h)
    if strided:  # the first h columns of rows twice as wide: a row stride the GEMM's TMA descriptor carries
        hidden = torch.cat([hidden, hidden], 1)[:, :h]
        assert hidden.stride() == (2 * h, 1)
    with dispatch.recording() as rec:
        out = rlkernel.linear_logp(hidden, weight, ids, bias=b, temperature=temperature, return_entropy=entropy,
                                   backend="fused", logits_dtype=torch.float32 if f32 else None)
    took_epilogue()
    assert rec.statuses() == {"fused"}
    lp, ent = out if entropy else (out, None)
    rlp, rent, tol_lp, tol_ent, _ = reference(exact_logits(hidden, weight, b), ids, temperature)
    assert_within(lp, rlp, tol_lp, "logp")
    assert torch.all(lp[ids == IGNORE] == 0)
    if entropy:
        assert_within(ent, rent, tol_ent, "entropy")
        assert torch.all(ent[ids == IGNORE] == 0)


def test_random_inputs_within_the_float32_gemm_error(epi):
    """Random (not dyadic) inputs: float64 of the exact product, plus what a float32 GEMM may add:
    |dx| <= 4 K 2^-24 (|h| @ |w|^T) + 2^-23 |x| per logit, so logp moves by at most 2 max|dz| and the entropy by
    max|dz| E_p|log p + H| (z = x / T)."""
    n, h, v, t = 200, 896, 5003, 0.8
    hidden, weight, b, ids = make(n, h, v, torch.bfloat16, seed=3)
    lp, ent = rlkernel.linear_logp(hidden, weight, ids, bias=b, temperature=t, return_entropy=True, backend="fused")
    took_epilogue()
    exact, dz = gemm_error(hidden, weight, b, t)
    rlp, rent, tol_lp, tol_ent, _ = reference(exact, ids, t)
    assert_within(lp, rlp, tol_lp + 2 * dz, "logp")
    logp_all = torch.log_softmax(exact / t, -1)
    spread = (logp_all.exp() * (logp_all + rent[:, None]).abs()).sum(-1)
    assert_within(ent, rent, tol_ent + dz * (1 + spread), "entropy")


def took_grad_epilogue(expected: bool) -> None:
    """The float32-logits backwards took the gradient epilogue (expected) or the float32 tile, and nothing else."""
    from rlkernel.ops.fused import epilogue_gemm

    rec = epilogue_gemm.grad_records()
    kernel = "epilogue" if expected else "tile"
    assert rec and all(k == kernel for k, _ in rec), rec


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias_grad", [True, False], ids=["bias-grad-float32-tile", "gradient-epilogue"])
def test_gradients_after_the_epilogue_forward_match_float64(epi, bias_grad, dtype):
    """The backward after the epilogue forward (the float32-logits backward): gradients vs float64 of the exact
    product (dyadic inputs: both GEMMs exact), the cuBLAS path's tolerances (tests/test_linear_logp_fused.py).
    Without a bias gradient the backward's gradient tiles come from the gradient epilogue, with one from the
    float32 tile and the grad kernel. float16 runs config 0 whatever the fixture says."""
    n, h, v, t = 150, 128, 3001, 0.8
    hidden, weight, b, ids = make_dyadic(n, h, v, dtype, bias=True, seed=31)
    ids[5] = v - 1  # a target in the vocabulary's last, partial tile
    leaves = [x.detach().clone().requires_grad_(True) for x in (hidden, weight)]
    leaves.append(b.detach().clone().requires_grad_(bias_grad))
    g = torch.Generator(device="cuda").manual_seed(7)
    gl, gh = torch.randn(n, device="cuda", generator=g), torch.randn(n, device="cuda", generator=g)
    with epi.chunking(64, 1024):  # several row blocks and vocabulary chunks, the last chunk partial
        lp, ent = rlkernel.linear_logp(*leaves[:2], ids, bias=leaves[2], temperature=t, return_entropy=True,
                                       backend="fused")
        torch.autograd.backward([lp, ent], [gl, gh])
    took_epilogue()
    took_grad_epilogue(not bias_grad)
    _, _, _, _, grad = reference(exact_logits(hidden, weight, b), ids, t)
    G, size = grad(gl, gh)
    u = UNIT[dtype]
    h64, w64 = hidden.double(), weight.double()
    slack = 0.0  # dyadic inputs: the forward's and the backward's float32 logits are both exact
    tol_h = ((3 * u + v * 2.0 ** -24) * (G.abs() @ w64.abs()) + (1e-5 * size + slack) @ w64.abs()
             + u * (G @ w64).abs() + 1e-30)
    assert_within(leaves[0].grad, G @ w64, tol_h, "hidden grad")
    block = 64  # the row blocks of the chunking above
    tol_w = (((2 + math.ceil(n / block)) * u + n * 2.0 ** -24) * (G.abs().t() @ h64.abs())
             + (1e-5 * size + slack).t() @ h64.abs() + u * (G.t() @ h64).abs() + 1e-30)
    assert_within(leaves[1].grad, G.t() @ h64, tol_w, "weight grad")
    tol_b = (2 * u + n * 2.0 ** -24) * G.abs().sum(0) + (1e-5 * size + slack).sum(0) + u * G.sum(0).abs() + 1e-30
    if bias_grad:
        assert_within(leaves[2].grad, G.sum(0), tol_b, "bias grad")
    assert torch.all(leaves[0].grad[ids == IGNORE] == 0)


def test_forward_runs_only_the_two_epilogue_kernels(epi):
    """No GEMM of cuBLAS and no logits in the forward's range: the epilogue GEMM and its merge, rlkernel_* names."""
    from torch.profiler import ProfilerActivity, profile

    hidden, weight, b, ids = make(256, 128, 5000, torch.bfloat16, seed=2)
    rlkernel.linear_logp(hidden, weight, ids, bias=b, return_entropy=True, backend="fused")  # warm-up
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        rlkernel.linear_logp(hidden, weight, ids, bias=b, return_entropy=True, backend="fused")
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    kernels = {nm for nm in names if "memset" not in nm.lower() and "memcpy" not in nm.lower()}
    assert any("rlkernel_linear_logp_epilogue_gemm_kernel" in nm for nm in kernels), kernels
    assert any("rlkernel_linear_logp_epilogue_merge_kernel" in nm for nm in kernels), kernels
    assert all("rlkernel_linear_logp_epilogue_" in nm for nm in kernels), kernels
    took_epilogue()


def test_backward_with_the_gradient_epilogue_writes_no_float32_tile(epi):
    """The backward runs the gradient epilogue GEMM and not the grad kernel (the float32 tile's reader), and its
    record says so."""
    from torch.profiler import ProfilerActivity, profile

    hidden, weight, b, ids = make(256, 128, 5000, torch.bfloat16, seed=3)
    leaves = [x.detach().clone().requires_grad_(True) for x in (hidden, weight)]

    def step():
        lp, ent = rlkernel.linear_logp(*leaves, ids, bias=b, return_entropy=True, backend="fused")
        (lp.sum() + ent.sum()).backward()

    step()  # warm-up
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    assert any("rlkernel_linear_logp_grad_epilogue_gemm_kernel" in nm for nm in names), names
    assert not any("rlkernel_linear_logp_grad_kernel" in nm for nm in names), names
    took_epilogue()
    took_grad_epilogue(True)


def test_forward_memory_is_the_partials_not_the_logits(epi):
    n, h, v = 4096, 256, 50000
    hidden, weight, _, ids = make(n, h, v, torch.bfloat16, bias=False, seed=9)
    rlkernel.linear_logp(hidden, weight, ids, backend="fused")
    torch.cuda.synchronize()
    base_mem = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    rlkernel.linear_logp(hidden, weight, ids, return_entropy=True, backend="fused")
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base_mem
    from rlkernel.ops.fused import epilogue_gemm

    partials = n * torch.ops.rlkernel.linear_logp_epilogue_tiles(v, epilogue_gemm.config_for(torch.bfloat16)) * 16
    assert extra <= partials + n * 64 + (2 << 20), (extra, partials)
    assert extra < n * v * 2 // 4  # a quarter of the bf16 logits
    took_epilogue()


def test_shapes_outside_the_kernel_fall_back_with_the_reason(epi):
    from rlkernel.ops.fused import epilogue_gemm

    hidden, weight, b, ids = make(40, 33, 700, torch.bfloat16, seed=5)  # H = 33: TMA needs multiples of 8
    lp = rlkernel.linear_logp(hidden, weight, ids, bias=b, backend="fused")
    rec = epilogue_gemm.records()
    why = "hidden size 0, or hidden size or row stride not a multiple of 8 (TMA's 16-byte strides)"
    assert set(rec) == {("cublas", why)}, rec
    x = base.op_logits(epi, hidden, weight, b)
    rlp, _, tol_lp, _, _ = reference(x, ids, 1.0)
    assert_within(lp, rlp, tol_lp, "logp (cuBLAS fallback)")
    epilogue_gemm.reset_records()
    rlkernel.linear_logp(hidden.float()[:, :32], weight.float()[:, :32], ids, backend="fused")
    assert set(epilogue_gemm.records()) == {("cublas", "torch.float32 inputs (bfloat16 / float16 only)")}
    epilogue_gemm.reset_records()
    hidden, weight, b, ids = make(40, 32, 700, torch.bfloat16, seed=6)
    shifted = torch.cat([hidden, hidden], 1)[:, 1:33]  # row stride 64, but 2 bytes off a 16-byte boundary
    rlkernel.linear_logp(shifted, weight, ids, bias=b, backend="fused")
    assert set(epilogue_gemm.records()) == {("cublas", "hidden or weight not 16-byte aligned (TMA)")}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_end_to_end_vs_exact_product_and_fused_vs_native(epi, dtype):
    base.test_end_to_end_vs_exact_product_and_fused_vs_native(epi, dtype)
    took_epilogue()


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_cuda_graph_capture_and_replay_equal_eager(epi, batch_invariant):
    base.test_cuda_graph_capture_and_replay_equal_eager(epi, batch_invariant)
    took_epilogue()


def test_no_host_sync_and_bad_ids_go_to_the_error_record(epi):
    base.test_no_host_sync_and_bad_ids_go_to_the_error_record(epi, "fused")
    took_epilogue()


def test_batch_invariant_rows_are_bitwise_the_same(epi):
    base.test_batch_invariant_rows_are_bitwise_the_same(epi, None, "fused")
    took_epilogue()


def test_batch_invariant_at_a_model_width(epi):
    base.test_batch_invariant_at_a_model_width(epi)
    took_epilogue()


def test_forward_rows_do_not_depend_on_the_batch_without_batch_invariant(epi):
    """The kernel's row independence (why BATCH_INVARIANT holds): row 3's logp / entropy bits, alone and inside
    batches (row blocks of the GEMM's 128-row tiles at other positions), with batch_invariant=False."""
    hidden, weight, b, ids = make(700, 96, 4099, torch.bfloat16, seed=13)

    def run(rows):
        return rlkernel.linear_logp(hidden[rows], weight, ids[rows], bias=b, return_entropy=True, backend="fused")

    one = run(torch.tensor([3], device="cuda"))
    for n, pos in ((7, 6), (700, 3), (300, 129), (129, 128)):
        rows = torch.arange(n, device="cuda")
        rows = torch.where(rows == pos, 3, torch.where(rows == 3, pos, rows))
        lp, ent = run(rows)
        assert torch.equal(lp[pos:pos + 1], one[0]) and torch.equal(ent[pos:pos + 1], one[1]), (n, pos)
    took_epilogue()


def test_empty_input_gives_empty_output_and_zero_gradients(epi):
    base.test_empty_input_gives_empty_output_and_zero_gradients(epi)


def test_linear_logp_loss_forward_half(epi, monkeypatch):
    """linear_logp_loss with the epilogue forward vs the cuBLAS path with float32 logits: the same loss and
    gradients up to the two float32 GEMMs' rounding, with and without gradients, over several chunks."""
    from rlkernel.ops.fused import epilogue_gemm

    n, h, v = 300, 128, 3001
    hidden, weight, b, ids = make_dyadic(n, h, v, torch.bfloat16, seed=17)
    adv = torch.randn(n, device="cuda")

    def loss_fn(lp, ent, sl):
        return -lp * adv[sl] - 0.01 * ent

    def run(enabled, grad):
        monkeypatch.setattr(epilogue_gemm, "ENABLED", enabled)
        leaves = [x.detach().clone().requires_grad_(grad) for x in (hidden, weight, b)]
        loss = rlkernel.linear_logp_loss(leaves[0], leaves[1], ids, loss_fn, bias=leaves[2], temperature=0.9,
                                         chunk_size=128, backend="fused",
                                         logits_dtype=None if enabled else torch.float32)
        if grad:
            loss.backward()
        return loss.detach(), [x.grad for x in leaves]

    epilogue_gemm.reset_records()
    got, got_g = run(True, True)
    took_epilogue()
    took_grad_epilogue(True)  # the loss's bias gradient is a GEMM of the 16-bit gradient: no float32 tile needed
    want, want_g = run(False, True)
    # dyadic inputs: both paths fold the same exact float32 logits; per token the two logp / entropy kernels differ
    # by their tolerances (~4e-5 + 2e-6 |value|), weighted by |adv| and 0.01
    tol = float((adv.abs() + 0.01).sum()) * 1e-4 + 1e-4
    assert abs(float(got) - float(want)) <= tol, (float(got), float(want), tol)
    for a, w, what in zip(got_g, want_g, ("hidden", "weight", "bias"), strict=True):
        # plus one unit in the last place of the gradients' own dtype: each path rounds its float32 gradient to bf16,
        # and values within the tolerance can round to neighbours (the H200 saw 2^-8 at |grad| ~ 1 against 2e-3)
        ulp = torch.finfo(a.dtype).eps * w.double().abs()
        assert_within(a, w.double(), 1e-3 * float(w.abs().max()) + 1e-5 + ulp, f"{what} grad")
    epilogue_gemm.reset_records()
    no_grad, _ = run(True, False)
    took_epilogue()
    assert abs(float(no_grad) - float(got)) <= 1e-5 * abs(float(got)) + 1e-5


@pytest.mark.parametrize("f32", [True, False], ids=["float32-logits", "bf16-logits"])
def test_auto_gives_one_answer_with_or_without_a_backward(f32, monkeypatch):
    """ENABLED='auto' at a hidden size it covers (H = 256 <= AUTO_MAX_HIDDEN): a float32-logits call takes the
    epilogue GEMM with and without a backward, a bf16-logits call the cuBLAS path both ways (its reason recorded), so
    the log-probs a rollout or a reference model takes without autograd are bitwise the ones the training forward
    gives, and the importance ratio of the two is exactly 1."""
    require_epilogue_build()
    from rlkernel.ops.fused import epilogue_gemm

    monkeypatch.setattr(epilogue_gemm, "ENABLED", "auto")
    hidden, weight, b, ids = make(200, 256, 3001, torch.bfloat16, bias=True, seed=5)
    kw = dict(bias=b, temperature=0.8, return_entropy=True, backend="fused",
              logits_dtype=torch.float32 if f32 else None)
    epilogue_gemm.reset_records()
    with torch.no_grad():
        old_lp, old_ent = rlkernel.linear_logp(hidden, weight, ids, **kw)
    h = hidden.detach().clone().requires_grad_(True)
    new_lp, new_ent = rlkernel.linear_logp(h, weight, ids, **kw)
    (new_lp.sum() + new_ent.sum()).backward()
    rec = epilogue_gemm.records()
    if f32:
        assert rec == {("epilogue", ""): 2}, rec
        assert epilogue_gemm.grad_records() == {("epilogue", ""): 1}, epilogue_gemm.grad_records()
    else:
        assert list(rec) == [("cublas", "ENABLED='auto': 16-bit logits asked for (the epilogue's are float32: the "
                                        "call's log-probs would depend on whether a backward runs)")], rec
        assert rec[next(iter(rec))] == 2
    assert torch.equal(old_lp, new_lp.detach()) and torch.equal(old_ent, new_ent.detach())
    assert torch.isfinite(h.grad).all() and h.grad.abs().sum() > 0
    epilogue_gemm.reset_records()
