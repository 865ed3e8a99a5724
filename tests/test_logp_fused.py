"""GPU tests of the fused log-prob backend against a float64 reference (skipped without CUDA or without the build).

Tolerances (fused float32 arithmetic vs float64 on the same input values):
- logp / entropy: atol 2e-5 nats + rtol 1e-6. The float32 sum of 2^(y - m) over up to 152K terms with ex2.approx
  (<= 2 ulp each) errs by ~1e-6 relative in s, i.e. ~1e-6 absolute in log s (x20 margin); c = log2(e)/T rounded to
  float32 scales every logit by a relative 6e-8, which |logp| up to 3e4 (logits 1e4, T 0.6) turns into rtol (x16).
- gradients: the output rounding of the logits dtype (half an ulp: 2^-9 bf16, 2^-11 fp16; doubled) relative to the
  reference, plus 1e-5 times the size of the terms that multiply p (p is recomputed in float32 from (r, log2 s):
  ~1e-5 relative for p > 2^-126), plus the dtype's subnormal spacing (fp16) / the float32 flush-to-zero floor.
"""
from __future__ import annotations

import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LN2 = math.log(2.0)
IGNORE = -100


@pytest.fixture(scope="module")
def fused():
    from rlkernel import _ext

    reason = _ext.unavailable_reason()
    if reason:  # a GPU without the build is a setup problem, not a pass: say so loudly
        pytest.fail(f"CUDA is available but rlkernel._C is not: {reason} (python setup.py build_ext --inplace)")
    from rlkernel.ops.fused import logp as logp_fused

    return logp_fused


def make_logits(n, v, dtype, *, scale=3.0, noncontig=False, seed=0):
    """Fresh random logits; noncontig: rows of a wider buffer starting at column 1 (row stride V+3, unaligned)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    width = v + 3 if noncontig else v
    base = torch.randn(n, width, device="cuda", generator=g, dtype=torch.float32).mul_(scale).to(dtype)
    x = base[:, 1:v + 1] if noncontig else base
    ids = torch.randint(0, v, (n,), device="cuda", generator=g)
    if n >= 3:  # row 0 ignored; row 1 with some -inf logits (and its target among them when V > 1); row 2 all -inf
        ids[0] = IGNORE
        k = max(1, v // 3)
        x[1, :k] = float("-inf")
        ids[1] = 0 if v > 1 else ids[1]
        x[2] = float("-inf")
    return x, ids


def reference(x, ids, temperature, g_l=None, g_h=None):
    """float64 logp, entropy and (with g_l/g_h) the gradient, with the contract's ignore/-inf/NaN rules."""
    z = x.double() / temperature
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    logp_all = z - lse
    p = logp_all.exp()
    valid = ids != IGNORE
    safe = torch.where(valid, ids, 0)
    logp = torch.where(valid, logp_all.gather(-1, safe[:, None])[:, 0], 0.0)
    plogp = torch.where(p > 0, p * logp_all, torch.where(p.isnan(), p, 0.0))
    ent = torch.where(valid, -plogp.sum(-1), 0.0)
    if g_l is None:
        return logp, ent, None, None
    onehot = torch.zeros_like(z).scatter_(-1, safe[:, None], 1.0)
    g_l = g_l.double()[:, None]
    g_h = torch.zeros_like(g_l) if g_h is None else g_h.double()[:, None]
    term = torch.where(p > 0, p * (logp_all + ent[:, None]), 0.0)
    grad = (g_l * (onehot - p) - g_h * term) / temperature
    grad = torch.where(valid[:, None], grad, 0.0)
    # size of what multiplies p in float32 (for the tolerance): |g_l + g_h H| + |g_h log p|, plus the onehot term
    lp = torch.where(p > 0, logp_all, 0.0)
    scale = (p * ((g_l + g_h * ent[:, None]).abs() + (g_h * lp).abs()) + onehot * g_l.abs()) / temperature
    return logp, ent, grad, torch.where(valid[:, None], scale, 0.0)


def assert_close(got, want, atol, rtol, what):
    """NaN where the reference is NaN, equal infinities, |got - want| <= atol + rtol |want| elsewhere."""
    got, want = got.double(), want.double()
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: NaN pattern differs"
    inf = want.isinf()
    assert torch.equal(got[inf], want[inf]), f"{what}: infinities differ"
    fin = ~(want.isnan() | inf)
    err = (got[fin] - want[fin]).abs()
    tol = atol + rtol * want[fin].abs() if not torch.is_tensor(atol) else atol[fin] + rtol * want[fin].abs()
    bad = err > tol
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        pytest.fail(f"{what}: {int(bad.sum())} elements out of tolerance, e.g. got {got[fin][i].item()!r} "
                    f"want {want[fin][i].item()!r} (max err {err.max().item():.3g})")


def same_bits(a, b):
    """Bitwise equality (NaN included), through an integer view of the same width."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ints), b.view(ints))


def poison_pool(*nbytes):
    """Fill freed allocator blocks of these sizes with 0xFF (NaN in every float dtype) so unwritten outputs show."""
    for n in nbytes:
        torch.empty(max(int(n), 1), dtype=torch.uint8, device="cuda").fill_(0xFF)


FWD_CASES = [  # (N, V, dtype, T, noncontig, scale): each axis value appears, not the full cross product
    (1, 128256, torch.float32, 0.6, False, 1e4),
    (3, 7, torch.bfloat16, 1.5, True, 3.0),
    (3, 151936, torch.float16, 1.0, True, 1e4),
    (3, 1, torch.float32, 1.0, False, 3.0),
    (4096, 4095, torch.float16, 0.6, False, 3.0),
    (4096, 32000, torch.bfloat16, 1.5, True, 3.0),
    (3, 151936, torch.float32, 1.5, False, 1e4),
]


@pytest.mark.parametrize("n,v,dtype,temperature,noncontig,scale", FWD_CASES)
def test_forward_and_entropy_match_float64(fused, n, v, dtype, temperature, noncontig, scale):
    x, ids = make_logits(n, v, dtype, scale=scale, noncontig=noncontig, seed=n * 7 + v)
    poison_pool(4 * n, 8 * n)
    logp, ent = fused.logp_fused(x, ids, temperature=temperature, ignore_index=IGNORE, return_entropy=True,
                                 inplace_backward=False)
    want_logp, want_ent, _, _ = reference(x, ids, temperature)
    assert logp.dtype == torch.float32 and logp.shape == (n,)
    assert_close(logp, want_logp, 2e-5, 1e-6, "logp")
    assert_close(ent, want_ent, 2e-5, 1e-5, "entropy")
    if n >= 3:
        assert logp[0].item() == 0.0 and ent[0].item() == 0.0  # ignore_index row
        assert math.isnan(logp[2].item()) and math.isnan(ent[2].item())  # all -inf row (contract)
    again, _ = fused.logp_fused(x, ids, temperature=temperature, ignore_index=IGNORE, return_entropy=False,
                                inplace_backward=False)
    assert torch.equal(again.view(torch.int32), logp.view(torch.int32))  # bitwise, with or without entropy


GRAD_CASES = [  # (N, V, dtype, T, noncontig, scale, with entropy gradient)
    (3, 7, torch.float32, 0.6, True, 3.0, True),
    (64, 151936, torch.bfloat16, 1.0, False, 3.0, True),
    (16, 128256, torch.float16, 1.5, True, 1e4, False),
    (1, 32000, torch.bfloat16, 0.6, False, 3.0, False),
    (4096, 4095, torch.bfloat16, 1.0, False, 3.0, True),
]
OUT_RTOL = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-10, torch.float32: 0.0}
OUT_ATOL = {torch.bfloat16: 1e-37, torch.float16: 6e-8, torch.float32: 1e-37}


@pytest.mark.parametrize("n,v,dtype,temperature,noncontig,scale,with_entropy", GRAD_CASES)
def test_gradients_match_float64_in_place_and_not(fused, n, v, dtype, temperature, noncontig, scale, with_entropy):
    x, ids = make_logits(n, v, dtype, scale=scale, noncontig=noncontig, seed=n + v)
    g = torch.Generator(device="cuda").manual_seed(v)
    g_l = torch.randn(n, device="cuda", generator=g)
    g_h = torch.randn(n, device="cuda", generator=g) if with_entropy else None
    _, _, want, size = reference(x, ids, temperature, g_l, g_h)

    def run(inplace):
        leaf = x.detach().clone().requires_grad_(True)
        work = leaf
        if inplace:  # a non-leaf the in-place backward may overwrite; padded to keep unaligned row strides
            work = torch.nn.functional.pad(leaf, (1, 2))[:, 1:v + 1] if noncontig else leaf.clone()
        logp, ent = fused.logp_fused(work, ids, temperature=temperature, ignore_index=IGNORE,
                                     return_entropy=with_entropy, inplace_backward=inplace)
        loss = (logp * g_l).sum() + ((ent * g_h).sum() if with_entropy else 0.0)
        poison_pool(n * v * x.element_size())
        loss.backward()
        return leaf.grad

    grad = run(False)
    assert grad.dtype == dtype and grad.shape == x.shape
    assert_close(grad, want, OUT_ATOL[dtype] + 1e-5 * size, OUT_RTOL[dtype], "grad")
    if n >= 3:
        assert bool((grad[0] == 0).all()), "ignore_index row must get an exactly zero gradient"
        assert bool(grad[2].isnan().all()), "all -inf row: NaN gradient (contract)"
    grad_inplace = run(True)
    assert same_bits(grad_inplace, grad), "in-place backward must give the same bits"


def test_inplace_backward_overwrites_the_logits_storage(fused):
    x, ids = make_logits(8, 4096, torch.bfloat16, seed=3)
    work = x.clone().requires_grad_(True)
    rows = work * 1  # non-leaf; its storage receives the gradient
    logp, _ = fused.logp_fused(rows, ids, temperature=1.0, ignore_index=IGNORE, return_entropy=False,
                               inplace_backward=True)
    (grad,) = torch.autograd.grad(logp.sum(), rows)
    assert grad.data_ptr() == rows.data_ptr(), "in-place backward must return the logits' own storage"
    assert same_bits(rows.detach(), grad)


def _assert_rows_alone_bitwise(fused, x, ids, temperature, logp, ent, rows):
    """Each row, run alone (a fresh, aligned copy), gives the bits it got inside the batch."""
    for r in rows:
        alone, alone_ent = fused.logp_fused(x[r:r + 1].clone(), ids[r:r + 1], temperature=temperature,
                                            ignore_index=IGNORE, return_entropy=True, inplace_backward=False)
        assert alone.view(torch.int32).item() == logp[r:r + 1].view(torch.int32).item(), f"row {r}: logp bits"
        assert alone_ent.view(torch.int32).item() == ent[r:r + 1].view(torch.int32).item(), f"row {r}: entropy bits"


def test_bitwise_alone_vs_batch_of_16384(fused):
    n, v = 16384, 128256
    x, ids = make_logits(n, v, torch.bfloat16, seed=11)
    poison_pool(4 * n, 8 * n)
    logp, ent = fused.logp_fused(x, ids, temperature=1.0, ignore_index=IGNORE, return_entropy=True,
                                 inplace_backward=False)
    logp2, ent2 = fused.logp_fused(x, ids, temperature=1.0, ignore_index=IGNORE, return_entropy=True,
                                   inplace_backward=False)
    assert torch.equal(logp.view(torch.int32), logp2.view(torch.int32)) and torch.equal(ent.view(torch.int32),
                                                                                        ent2.view(torch.int32))
    rows = torch.randperm(n - 3, generator=torch.Generator().manual_seed(0))[:256] + 3
    rows = torch.cat([torch.tensor([0, 1, 2, n - 1]), rows]).cuda()
    want_logp, want_ent, _, _ = reference(x[rows], ids[rows], 1.0)
    assert_close(logp[rows], want_logp, 2e-5, 1e-6, "logp (batch)")
    assert_close(ent[rows], want_ent, 2e-5, 1e-5, "entropy (batch)")
    assert bool(logp[3:].isfinite().all()) and bool(ent[1:2].isfinite().all() & ent[3:].isfinite().all())
    _assert_rows_alone_bitwise(fused, x, ids, 1.0, logp, ent, [3, 777, n - 1])


def test_bitwise_alone_vs_batch_unaligned_rows(fused):
    # V odd: in the batch, rows start at every 2-byte offset (element loads); alone, the clone is 16-byte aligned
    x, ids = make_logits(4096, 4095, torch.float16, seed=5)
    logp, ent = fused.logp_fused(x, ids, temperature=0.6, ignore_index=IGNORE, return_entropy=True,
                                 inplace_backward=False)
    _assert_rows_alone_bitwise(fused, x, ids, 0.6, logp, ent, [3, 4, 5, 6, 7, 8, 9, 10, 4095])


def test_nan_row_gives_nan(fused):
    x, ids = make_logits(5, 1000, torch.bfloat16, seed=9)
    x[3, 500] = float("nan")
    logp, ent = fused.logp_fused(x, ids, temperature=1.0, ignore_index=IGNORE, return_entropy=True,
                                 inplace_backward=False)
    assert math.isnan(logp[3].item()) and math.isnan(ent[3].item())
    assert math.isfinite(logp[4].item())


def test_bad_id_marks_row_nan_and_check_errors_raises(fused, monkeypatch):
    import rlkernel

    rlkernel.check_errors()
    x, ids = make_logits(6, 333, torch.float32, seed=2)
    ids[4] = 333  # == V: out of range
    ids[5] = -1
    logp, ent = fused.logp_fused(x, ids, temperature=1.0, ignore_index=IGNORE, return_entropy=True,
                                 inplace_backward=False)
    assert logp[4:].isnan().all() and ent[4:].isnan().all() and logp[3].isfinite()
    with pytest.raises(IndexError, match=r"\(4,\) \(id 333, vocab size 333\)"):
        rlkernel.check_errors()
    ids3 = ids.view(2, 3)  # leading shape [2, 3]: the position is reported in it
    fused.logp_fused(x.view(2, 3, 333), ids3, temperature=1.0, ignore_index=IGNORE, return_entropy=False,
                     inplace_backward=False)
    with pytest.raises(IndexError, match=r"\(1, 1\)"):
        rlkernel.check_errors()


def test_public_api_records_fused_and_agrees_with_native(fused):
    import rlkernel
    from rlkernel import dispatch

    b, t, v = 4, 37, 32000
    x, _ = make_logits(b * t, v, torch.bfloat16, seed=21)
    x = x.view(b, t, v)
    ids = torch.randint(0, v, (b, t), device="cuda")
    ids[1, :5] = IGNORE  # not rows 1-2 of make_logits (the -inf rows): those stay scored
    out = {}
    for backend in ("fused", "native"):
        leaf = x.detach().clone().requires_grad_(True)
        with dispatch.recording() as rec:
            logp, ent = rlkernel.logp(leaf, ids, temperature=0.6, return_entropy=True, backend=backend)
            (logp.sum() + 0.5 * ent.sum()).backward()
        out[backend] = (logp.detach(), ent.detach(), leaf.grad)
        want = "fused" if backend == "fused" else "native"
        assert {(r.op, r.status) for r, _ in rec.records} == {("logp.forward", want), ("logp.backward", want)}
    # both float32 implementations err by ~1e-6 vs float64 (see the module docstring): the sum, with margin
    assert_close(out["fused"][0], out["native"][0], 5e-5, 1e-5, "fused vs native logp")
    assert_close(out["fused"][1], out["native"][1], 5e-5, 1e-5, "fused vs native entropy")
    # gradients are bf16: each side rounds once (half an ulp, 2^-9), so they may differ by one bf16 ulp
    assert_close(out["fused"][2], out["native"][2], 1e-6, 2.0**-7, "fused vs native grad")


def test_empty_input(fused):
    x = torch.randn(0, 5, 100, device="cuda", dtype=torch.bfloat16)
    ids = torch.zeros(0, 5, dtype=torch.long, device="cuda")
    logp, ent = fused.logp_fused(x, ids, temperature=1.0, ignore_index=IGNORE, return_entropy=True,
                                 inplace_backward=False)
    assert logp.shape == (0, 5) and ent.shape == (0, 5)


def test_torch_compile_fullgraph(fused):
    x, ids = make_logits(64, 5000, torch.bfloat16, seed=4)

    def f(logits, ids):
        logp, ent = fused.logp_fused(logits, ids, temperature=0.6, ignore_index=IGNORE, return_entropy=True,
                                     inplace_backward=False)
        return (logp.nan_to_num() + ent.nan_to_num()).sum()

    compiled = torch.compile(f, fullgraph=True)
    a = x.detach().clone().requires_grad_(True)
    b = x.detach().clone().requires_grad_(True)
    compiled(a, ids).backward()
    f(b, ids).backward()
    assert torch.equal(a.grad.nan_to_num(), b.grad.nan_to_num())


def test_opcheck(fused):
    g = torch.Generator(device="cuda").manual_seed(8)
    # finite rows only: opcheck compares eager and traced outputs with allclose, which treats NaN as a mismatch
    x = torch.randn(6, 777, device="cuda", generator=g).requires_grad_(True)
    ids = torch.randint(0, 777, (6,), device="cuda", generator=g)
    ids[1] = IGNORE
    from rlkernel import errors

    # (..., error_record, error_seq, error_op, inplace_backward, requested): reporting into a real record too
    sink = (errors.record(x.device).data_ptr(), 5, errors.ERR_LOGP_BAD_ID)
    torch.library.opcheck(torch.ops.rlkernel.logp_forward.default, (x, ids, 0.6, IGNORE, True, *sink, False, "fused"))
    torch.library.opcheck(torch.ops.rlkernel.logp_forward.default, (x, ids, 1.0, IGNORE, False, 0, 0, 1, False, "auto"))
    logp, ent, stats = torch.ops.rlkernel.logp_forward(x.detach(), ids, 0.6, IGNORE, True)
    gl = torch.randn(6, device="cuda", generator=g)
    args = (gl, gl * 0.5, x.detach(), ids, stats, ent, 0.6, IGNORE)
    torch.library.opcheck(torch.ops.rlkernel.logp_backward.default, args)
    torch.library.opcheck(torch.ops.rlkernel.logp_backward_inplace.default,
                          (gl, None, x.detach().clone(), ids, stats, ent, 0.6, IGNORE))
