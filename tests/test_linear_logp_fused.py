"""GPU tests of rlkernel.linear_logp's fused backend (skipped without CUDA; a CUDA machine without the build fails).

References are float64 from the very logits the op's GEMMs produce: ``op_logits`` repeats the op's cuBLAS calls
(same blocks, chunks, shapes and dtype), so the comparison measures our kernels, not the matmul's rounding.
Tolerances:
- logp / entropy vs float64 of those logits: atol 2e-5 + rtol 1e-6, as tests/test_logp_fused.py states for the fused
  log-prob kernels (float32 sums of ex2.approx terms), plus the float32 rounding of c = log2(e)/T (``reference``).
- gradients, elementwise: (2u + gamma_K) times the product of absolute values (|G| @ |W| for dH, |G|^T @ |H| for
  dW, column sums of |G| for the bias), plus 1e-5 times the same product of the size of what multiplies p (p is
  recomputed from (r, log2 s) in float32: ~1e-5 relative), plus u |g| for the output rounding. u: the dtype's unit
  roundoff (the gradient tile is rounded to the dtype before its GEMMs, the GEMM's output once more); gamma_K =
  K 2^-24, a float32 sum of K products. When cuBLAS cannot add into a float32 dH accumulator the dH sum is rounded
  once per vocabulary chunk (u each); dW is rounded once per row block.
- end to end vs the exact float64 product, and fused vs native (whose GEMMs may round a logit the other way): each
  logit carries at most one unit roundoff u |x|, so logp moves by at most 2 u max|x| / T (+ the kernel tolerance).
"""
from __future__ import annotations

import contextlib
import math

import pytest
import torch
from cuda_graphs import warm_on_side_stream

import rlkernel
from rlkernel import dispatch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

IGNORE = -100
UNIT = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


@pytest.fixture(scope="module")
def fused():
    from rlkernel import _ext

    reason = _ext.unavailable_reason()
    if reason:  # a GPU without the build is a setup problem, not a pass
        pytest.fail(f"CUDA is available but rlkernel._C is not: {reason} (python setup.py build_ext --inplace)")
    from rlkernel.ops.fused import linear_logp as linear_logp_fused

    rlkernel.check_errors()
    yield linear_logp_fused
    with contextlib.suppress(IndexError, ValueError):
        rlkernel.check_errors()


def make(n, h, v, dtype, *, scale=3.0, bias=True, strided=False, seed=0, shift=0.0):
    """Fresh random CUDA inputs: hidden [n, h] (strided: every other column of a wider buffer), weight [v, h], bias,
    ids with row 1 ignored (n > 2)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    width = 2 * h if strided else h
    base = torch.randn(n, width, device="cuda", generator=g)
    hidden = (base[:, ::2] if strided else base).to(dtype)
    weight = (torch.randn(v, h, device="cuda", generator=g) * scale / math.sqrt(h)).to(dtype)
    b = (torch.randn(v, device="cuda", generator=g) * scale * 0.5 + shift).to(dtype) if bias else None
    ids = torch.randint(0, v, (n,), device="cuda", generator=g)
    if n > 2:
        ids[1] = IGNORE
    return hidden, weight, b, ids


def op_logits(fused, hidden, weight, bias, batch_invariant=False):
    """The logits exactly as the op's GEMMs write them (same calls per block and chunk), as float64 [n, v]."""
    n, hsize = hidden.shape
    v = weight.shape[0]
    block, cols = fused.plan(n, v, hidden.dtype, batch_invariant)
    out = torch.empty(n, v, dtype=torch.float64, device=hidden.device)
    rows2d = fused.as_rows(hidden)  # the op's own view (or copy) of the rows: same pointers, same GEMM choice
    for r0 in range(0, n, block):
        r1 = min(n, r0 + block)
        h = rows2d[r0:r1]
        if batch_invariant:
            h = torch.cat([h, h.new_zeros(block - (r1 - r0), hsize)])
        for c0 in range(0, v, cols):
            c1 = min(v, c0 + cols)
            tile = torch.empty(h.shape[0], c1 - c0, dtype=hidden.dtype, device=hidden.device)
            fused._logits_tile(h, weight, bias, c0, c1, tile)
            out[r0:r1, c0:c1] = tile[: r1 - r0].double()
    return out


def reference(x, ids, temperature):
    """float64 (logp, entropy, their kernel tolerances, logits-gradient function) of logits x.

    Tolerances: atol 2e-5 + rtol 1e-6 (the fused log-prob kernels' own, tests/test_logp_fused.py), plus the effect of
    c = log2(e) / T rounded to float32 (a relative 2^-24 scaling of every z = x / T; doubled): d logp / d(scale) =
    z_t - E_p[z], d entropy / d(scale) = -Var_p(z)."""
    z = x / temperature
    logp_all = torch.log_softmax(z, -1)
    p = logp_all.exp()
    valid = ids != IGNORE
    safe = torch.where(valid, ids, 0)
    lp = torch.where(valid, logp_all.gather(-1, safe[:, None])[:, 0], 0.0)
    ent = torch.where(valid, -torch.where(p > 0, p * logp_all, 0.0).sum(-1), 0.0)
    mean_z = (p * z).sum(-1)
    var_z = (p * (z - mean_z[:, None]) ** 2).sum(-1)
    z_t = z.gather(-1, safe[:, None])[:, 0]
    tol_lp = 2e-5 + 1e-6 * lp.abs() + 2.0 ** -23 * (z_t - mean_z).abs()
    tol_ent = 2e-5 + 1e-6 * ent.abs() + 2.0 ** -23 * var_z

    def grad(gl, gh):
        """(gradient of sum(gl logp + gh entropy) w.r.t. x, the size of what multiplies p in it, for tolerances)."""
        onehot = torch.zeros_like(z).scatter_(-1, safe[:, None], 1.0)
        gl2, gh2 = gl.double()[:, None], gh.double()[:, None]
        term = torch.where(p > 0, p * (logp_all + ent[:, None]), 0.0)
        g = (gl2 * (onehot - p) - gh2 * term) / temperature
        size = (p * ((gl2 + gh2 * ent[:, None]).abs() + (gh2 * torch.where(p > 0, logp_all, 0.0)).abs())
                + onehot * gl2.abs()) / temperature
        keep = valid[:, None]
        return torch.where(keep, g, 0.0), torch.where(keep, size, 0.0)

    return lp, ent, tol_lp, tol_ent, grad


def assert_within(got, want, tol, what):
    err = (got.double() - want).abs()
    bad = ~(err <= tol)
    if bool(bad.any()):
        i = int(bad.flatten().nonzero()[0])
        pytest.fail(f"{what}: {int(bad.sum())} elements out of tolerance, e.g. flat {i}: got "
                    f"{got.flatten()[i].item()!r} want {want.flatten()[i].item()!r} tol {tol.flatten()[i].item():.3g}"
                    if torch.is_tensor(tol) else f"{what}: max err {err.max().item():.3g} > {tol:.3g}")


CASES = [  # (N, H, V, dtype, T, strided, bias, chunking (rows, cols) or None)
    (37, 64, 4096, torch.bfloat16, 1.0, False, False, None),
    (5, 33, 101, torch.float32, 0.7, True, True, None),
    (129, 65, 4095, torch.float16, 1.3, False, True, (48, 1000)),
    (300, 128, 2049, torch.float32, 1.0, True, False, (128, 512)),
    (64, 31, 999, torch.bfloat16, 0.6, True, True, (64, 256)),
]


@pytest.mark.parametrize("n,h,v,dtype,temperature,strided,bias,chunk", CASES)
def test_forward_and_gradients_match_float64(fused, n, h, v, dtype, temperature, strided, bias, chunk):
    hidden, weight, b, ids = make(n, h, v, dtype, bias=bias, strided=strided, seed=n + v)
    ctx = fused.chunking(*chunk) if chunk else contextlib.nullcontext()
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in (hidden, weight, b)]
    if strided:
        leaves[0] = hidden.detach().requires_grad_(True)  # keep the strided layout
    g = torch.Generator(device="cuda").manual_seed(7)
    gl, gh = torch.randn(n, device="cuda", generator=g), torch.randn(n, device="cuda", generator=g)
    with ctx, dispatch.recording() as rec:
        lp, ent = rlkernel.linear_logp(leaves[0], leaves[1], ids, bias=leaves[2], temperature=temperature,
                                       return_entropy=True, backend="fused")
        torch.autograd.backward([lp, ent], [gl, gh])
        x = op_logits(fused, hidden, weight, b)
        block, cols = fused.plan(n, v, dtype, False)
    assert {(r.op, r.status) for r, _ in rec.records} == {("linear_logp.forward", "fused"),
                                                          ("linear_logp.backward", "fused")}
    rlp, rent, tol_lp, tol_ent, grad = reference(x, ids, temperature)
    assert_within(lp, rlp, tol_lp, "logp")
    assert_within(ent, rent, tol_ent, "entropy")
    assert torch.all(lp[ids == IGNORE] == 0) and torch.all(ent[ids == IGNORE] == 0)
    G, size = grad(gl, gh)
    u = UNIT[dtype]
    h64, w64 = hidden.double(), weight.double()
    chunks, blocks = math.ceil(v / cols), math.ceil(n / block)
    acc32 = fused.dh_accumulation(hidden.device, dtype) != "dtype"
    k_h = 2 + (0 if acc32 else chunks)  # rounding of G, of the output, and of each partial dH sum without fp32
    tol_h = ((k_h * u + v * 2.0 ** -24) * (G.abs() @ w64.abs()) + 1e-5 * (size @ w64.abs())
             + u * (G @ w64).abs() + 1e-30)
    assert_within(leaves[0].grad, G @ w64, tol_h, "hidden grad")
    tol_w = (((2 + blocks) * u + n * 2.0 ** -24) * (G.abs().t() @ h64.abs()) + 1e-5 * (size.t() @ h64.abs())
             + u * (G.t() @ h64).abs() + 1e-30)
    assert_within(leaves[1].grad, G.t() @ h64, tol_w, "weight grad")
    if bias:
        tol_b = ((2 * u + n * 2.0 ** -24) * G.abs().sum(0) + 1e-5 * size.sum(0) + u * G.sum(0).abs() + 1e-30)
        assert_within(leaves[2].grad, G.sum(0), tol_b, "bias grad")
    assert torch.all(leaves[0].grad[ids == IGNORE] == 0)


@pytest.mark.parametrize("case", [1, 2])
def test_bias_added_by_our_kernel_and_a_beta_1_gemm(fused, monkeypatch, case):
    """The bias path that does not rely on cuBLASLt's epilogue (BIAS_EPILOGUE = False), on the bias cases above."""
    monkeypatch.setattr(fused, "BIAS_EPILOGUE", False)
    assert CASES[case][6], "a case with a bias"
    test_forward_and_gradients_match_float64(fused, *CASES[case])


@pytest.mark.parametrize("shift,scale", [(-3e3, 1.0), (0.0, 3e3)], ids=["all-negative", "extreme"])
def test_all_negative_and_extreme_logits(fused, shift, scale):
    hidden, weight, b, ids = make(40, 32, 3001, torch.float32, scale=scale, shift=shift, seed=4)
    with fused.chunking(16, 1024):
        lp, ent = rlkernel.linear_logp(hidden, weight, ids, bias=b, return_entropy=True, backend="fused")
        x = op_logits(fused, hidden, weight, b)
    if shift:
        assert float(x.max()) < -2000
    rlp, rent, tol_lp, tol_ent, _ = reference(x, ids, 1.0)
    # never a positive log-prob (verl #2656) beyond the float32 rounding of ex2.approx / log2 near p = 1
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all() and bool((lp <= 1e-6).all())
    assert_within(lp, rlp, tol_lp, "logp")
    assert_within(ent, rent, tol_ent, "entropy")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_end_to_end_vs_exact_product_and_fused_vs_native(fused, dtype):
    n, h, v, t = 200, 96, 5003, 0.9
    hidden, weight, b, ids = make(n, h, v, dtype, seed=3)
    lp_f, ent_f = rlkernel.linear_logp(hidden, weight, ids, bias=b, temperature=t, return_entropy=True,
                                       backend="fused")
    lp_n, ent_n = rlkernel.linear_logp(hidden, weight, ids, bias=b, temperature=t, return_entropy=True,
                                       backend="native")
    exact = hidden.double() @ weight.double().t() + b.double()
    rlp, rent, _, _, _ = reference(exact, ids, t)
    dx = 2 * UNIT[dtype] * float(exact.abs().max()) / t + 2 * h * 2.0 ** -24 * float(exact.abs().max())
    tol = 4e-5 + dx
    assert_within(lp_f, rlp, tol, "fused logp vs exact product")
    assert_within(lp_f, lp_n.double(), tol, "fused vs native logp")
    tol_ent = tol * (1 + math.log(v) + 2 * float(exact.abs().max()) / t)
    assert_within(ent_f, ent_n.double(), tol_ent, "fused vs native entropy")
    assert_within(ent_f, rent, tol_ent, "fused entropy vs exact product")


def test_logp_only_and_entropy_only_gradients(fused):
    hidden, weight, b, ids = make(50, 40, 1500, torch.float32, seed=8)
    with fused.chunking(32, 512):
        for which in ("logp", "entropy"):
            leaves = [t.clone().requires_grad_(True) for t in (hidden, weight)]
            lp, ent = rlkernel.linear_logp(*leaves, ids, return_entropy=True, backend="fused")
            (lp if which == "logp" else ent).sum().backward()
            ref = [t.clone().requires_grad_(True) for t in (hidden, weight)]
            lp_n, ent_n = rlkernel.linear_logp(*ref, ids, return_entropy=True, backend="native")
            (lp_n if which == "logp" else ent_n).sum().backward()
            for a, r in zip(leaves, ref, strict=True):
                assert_within(a.grad, r.grad.double(), 1e-4 * float(r.grad.abs().max()) + 1e-6, which)


@pytest.mark.parametrize("chunk,backend", [(None, "fused"), ((64, 1000), "fused"), (None, "native")])
def test_batch_invariant_rows_are_bitwise_the_same(fused, chunk, backend):
    """Row 3 of a fixed set of inputs, alone and inside batches of many sizes at many positions: logp, entropy and
    its hidden gradient carry the same bits (both backends)."""
    h, v = 96, 4099
    hidden, weight, b, ids = make(4200, h, v, torch.bfloat16, seed=12)
    ctx = fused.chunking(*chunk) if chunk else contextlib.nullcontext()

    def run(rows):
        x = hidden[rows].clone().requires_grad_(True)
        lp, ent = rlkernel.linear_logp(x, weight, ids[rows], bias=b, return_entropy=True, batch_invariant=True,
                                       backend=backend)
        (0.7 * lp.sum() + 0.3 * ent.sum()).backward()
        return lp.detach(), ent.detach(), x.grad

    with ctx:
        one = run(torch.tensor([3], device="cuda"))
        for n, pos in ((7, 0), (7, 6), (4096, 4095), (4097, 4096), (4200, 3), (3000, 1500), (130, 65)):
            rows = torch.arange(n, device="cuda")
            rows = torch.where(rows == pos, 3, torch.where(rows == 3, pos, rows))  # row 3 moved to `pos`
            lp, ent, gx = run(rows)
            assert torch.equal(lp[pos:pos + 1], one[0]), (n, pos)
            assert torch.equal(ent[pos:pos + 1], one[1]), (n, pos)
            assert torch.equal(gx[pos:pos + 1], one[2]), (n, pos)


def test_batch_invariant_at_a_model_width(fused):
    """The same at H = 4096 with more than one vocabulary chunk: GEMM shapes where cuBLAS picks its production
    kernels (a kernel whose split of K depended on the output tile would show here)."""
    h, v = 4096, 20000
    g = torch.Generator(device="cuda").manual_seed(21)
    hidden = torch.randn(4200, h, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(v, h, device="cuda", generator=g) / 32).bfloat16()
    ids = torch.randint(0, v, (4200,), device="cuda", generator=g)

    def run(rows):
        x = hidden[rows].clone().requires_grad_(True)
        lp, ent = rlkernel.linear_logp(x, weight, ids[rows], return_entropy=True, batch_invariant=True,
                                       backend="fused")
        (0.7 * lp.sum() + 0.3 * ent.sum()).backward()
        return lp.detach(), ent.detach(), x.grad

    one = run(torch.tensor([3], device="cuda"))
    for n, pos in ((4097, 4096), (4200, 3), (2000, 1999), (4096, 2500)):
        rows = torch.arange(n, device="cuda")
        rows = torch.where(rows == pos, 3, torch.where(rows == 3, pos, rows))
        lp, ent, gx = run(rows)
        assert torch.equal(lp[pos:pos + 1], one[0]), ("logp", n, pos)
        assert torch.equal(ent[pos:pos + 1], one[1]), ("entropy", n, pos)
        assert torch.equal(gx[pos:pos + 1], one[2]), ("hidden grad", n, pos)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_cuda_graph_capture_and_replay_equal_eager(fused, batch_invariant):
    hidden, weight, b, ids = make(300, 64, 3001, torch.bfloat16, seed=5)
    x = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)

    def step():
        x.grad = None
        w.grad = None
        lp, ent = rlkernel.linear_logp(x, w, ids, bias=b, temperature=0.9, return_entropy=True,
                                       batch_invariant=batch_invariant, backend="fused")
        (lp.sum() - 0.01 * ent.sum()).backward()
        return lp.detach(), ent.detach(), x.grad, w.grad

    eager = [t.clone() for t in step()]
    warm_on_side_stream(step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for a, e in zip(captured, eager, strict=True):
        assert torch.equal(a, e)


@pytest.mark.parametrize("backend", ["fused", "native"])
def test_no_host_sync_and_bad_ids_go_to_the_error_record(fused, backend):
    hidden, weight, b, ids = make(64, 32, 1001, torch.bfloat16, seed=6)
    ids[9] = 1001  # out of range
    x = hidden.clone().requires_grad_(True)
    rlkernel.check_errors()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lp, ent = rlkernel.linear_logp(x, weight, ids, bias=b, return_entropy=True, backend=backend)
        (lp.sum() + ent.sum()).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert bool(lp[9].isnan()) and bool(ent[9].isnan())
    assert bool(torch.isfinite(lp[torch.arange(64, device="cuda") != 9]).all())
    assert bool(x.grad[9].isnan().all())
    with pytest.raises(IndexError, match=r"linear_logp.forward: token id out of range at position \(9,\) "
                                         r"\(id 1001, vocab size 1001\)"):
        rlkernel.check_errors()


def test_peak_memory_stays_below_the_logits(fused):
    """Forward + backward at a shape whose logits alone would be 2 x 200 MB: the extra memory (beyond the inputs and
    the returned gradients) stays within the planned tile, the float32 dH accumulator and small row state."""
    n, h, v, dtype = 2048, 512, 50000, torch.bfloat16
    hidden, weight, _, ids = make(n, h, v, dtype, bias=False, seed=9)
    x = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    rlkernel.linear_logp(x, w, ids, backend="fused").sum().backward()  # warm-up (probe, allocator)
    x.grad = w.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    rlkernel.linear_logp(x, w, ids, backend="fused").sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - (x.grad.numel() + w.grad.numel()) * 2
    block, cols = fused.plan(n, v, dtype, False)
    accumulators = 2 if fused.dh_accumulation(x.device, dtype) == "mm+add" else 1  # float32 [block, H] each
    budget = block * cols * 2 + accumulators * block * h * 4 + n * 64 + (8 << 20)
    assert extra <= budget, (extra, budget)
    assert extra < n * v * 2  # less than the bf16 logits alone


def test_dispatch_records_and_auto_picks_fused(fused):
    hidden, weight, b, ids = make(8, 16, 300, torch.float16, seed=1)
    with dispatch.recording() as rec:
        rlkernel.linear_logp(hidden, weight, ids)
    assert rec.records and rec.statuses() == {"fused"}
    with dispatch.recording() as rec:
        rlkernel.linear_logp(hidden.double(), weight.double(), ids)  # float64: a recorded fallback
    assert rec.statuses() == {"fallback"}


def test_empty_input_gives_empty_output_and_zero_gradients(fused):
    hidden, weight, b, ids = make(0, 16, 300, torch.bfloat16, seed=2)
    w = weight.clone().requires_grad_(True)
    bias = b.clone().requires_grad_(True)
    lp, ent = rlkernel.linear_logp(hidden, w, ids, bias=bias, return_entropy=True, backend="fused")
    assert lp.shape == ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(bias.grad, torch.zeros_like(bias))


@pytest.mark.parametrize("name", ["linear-logp-fused", "linear-logp-fused-bwd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_registry_workloads_run_fused_and_check_clean(fused, name, dtype):
    from rlkernel import workloads

    w = workloads.get(name)
    inputs = w.make_inputs(workloads.Shape(2, 64, 5003, hidden_size=256), dtype, "cuda", seed=0)
    with dispatch.recording() as rec:
        w.repetition(inputs)
    assert rec.statuses() == {"fused"} and {r.op for r, _ in rec.records} == set(w.fused_ops)
    assert w.check(inputs) is None
