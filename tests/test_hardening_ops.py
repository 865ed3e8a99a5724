"""Regression tests for the ops items of issue 29 (Hardening), one test per item, named by its number, written
against the public entry points (rlkernel.logp, sample, linear_logp, linear_logp_loss, and torch.compile of them).

3: processed logp of a row without a distribution (all -inf) is NaN (logp, entropy, gradient), as plain logp's;
4: a NaN logit on the processed path gives NaN, as on the plain path;
8: torch.compile with the default inductor backend: what the contract now claims for the native path on CPU;
9: double backward is refused with a RuntimeError naming the op (never a silent NaN or a silently dropped term);
10: uint64 token ids are refused (2^64 - 1 would wrap to -1);
21: a hidden size of 0 is refused before any work;
and the decision on a float64 per-row temperature that rounds to 0 in float32.
The tests marked gpu run the CUDA paths (native and fused) of the same items.
"""
import contextlib
import shutil

import pytest
import torch

import rlkernel

NINF, NAN = float("-inf"), float("nan")
# every kind of filter that sends rlkernel.logp to the processed path
FILTERS = [pytest.param(dict(top_k=2), id="top_k"), pytest.param(dict(top_p=0.5), id="top_p"),
           pytest.param(dict(min_p=0.1), id="min_p"), pytest.param(dict(temperature=0.0), id="T0"),
           pytest.param("ones", id="T-rows"), pytest.param(dict(top_k=3, top_p=0.9, min_p=0.05), id="all")]
CUDA_BACKENDS = [pytest.param("native", id="cuda-native"), pytest.param("fused", id="cuda-fused")]
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _kw(filt, n, vocab, device):
    if filt == "ones":
        return dict(temperature=torch.ones(n, device=device))
    if filt == "k=V-1":  # fused: past kMaxFastK (128) the whole-row path, below it the fast one
        return dict(top_k=vocab - 1)
    return dict(filt)


def _need(backend):
    if backend == "fused":
        from rlkernel import _ext

        # not a skip: on a CUDA machine these tests need the build (python setup.py build_ext --inplace)
        assert _ext.unavailable_reason() is None and _ext.has_op("logp_processed_forward"), _ext.unavailable_reason()


@contextlib.contextmanager
def _clean_record():
    rlkernel.check_errors()
    yield
    with contextlib.suppress(IndexError, ValueError):
        rlkernel.check_errors()


# ---- 3 and 4: rows without a distribution on the processed path ---------------------------------------------------

def _dead_rows(vocab, device, dtype=torch.float32):
    """Rows: 0 all -inf, 1 a NaN at a token that is not the id, 2 a NaN at the id, 3 normal, 4 all -inf but ignored,
    5 +inf at T > 0 (no distribution either, unless T = 0). Ids: 1 (row 3: its argmax, kept by every filter; row 4:
    ignore_index)."""
    g = torch.Generator().manual_seed(29)
    x = torch.randn(6, vocab, generator=g).to(dtype)
    x[0] = NINF
    x[1, vocab - 1] = NAN
    x[2, 1] = NAN
    x[4] = NINF
    x[5, 0] = float("inf")
    ids = torch.ones(6, dtype=torch.int64)
    ids[3] = x[3].argmax()
    ids[4] = -100
    return x.to(device), ids.to(device)


def _check_dead_rows(filt, device, backend, vocab, rows, dtype=torch.float32):
    x, ids = _dead_rows(vocab, device, dtype)
    kw = _kw(filt, x.shape[0], vocab, device)
    greedy = isinstance(filt, dict) and filt.get("temperature") == 0.0
    x.requires_grad_(True)
    lp, ent = rlkernel.logp(x, ids, return_entropy=True, backend=backend, **kw)
    (lp.nan_to_num(0.0, 0.0, 0.0).sum() + ent.nan_to_num(0.0, 0.0, 0.0).sum()).backward()
    lp, ent, grad = lp.detach().cpu(), ent.detach().cpu(), x.grad.float().cpu()
    dead = [r for r in rows if not (greedy and r == 5)]  # T = 0: a +inf logit is the argmax, a fine row
    for r in dead:
        assert torch.isnan(lp[r]), f"row {r}: logp {lp[r].item()}, not NaN"
        assert torch.isnan(ent[r]), f"row {r}: entropy {ent[r].item()}, not NaN"
        assert bool(grad[r].isnan().all()), f"row {r}: gradient {grad[r].tolist()}, not NaN"
    assert torch.isfinite(lp[3]) and torch.isfinite(ent[3]) and bool(grad[3].isfinite().all())
    assert lp[4].item() == 0.0 and ent[4].item() == 0.0 and bool((grad[4] == 0).all())  # ignored: 0, no gradient


@pytest.mark.parametrize("filt", FILTERS)
def test_item3_processed_logp_of_an_all_neginf_row_is_nan(filt):
    _check_dead_rows(filt, "cpu", "auto", 7, rows=[0, 5])


@pytest.mark.parametrize("filt", FILTERS)
def test_item4_processed_logp_of_a_nan_row_is_nan_as_plain(filt):
    _check_dead_rows(filt, "cpu", "auto", 7, rows=[1, 2])
    x, ids = _dead_rows(7, "cpu")
    plain, plain_ent = rlkernel.logp(x, ids, return_entropy=True)
    assert bool(plain[[1, 2]].isnan().all()) and bool(plain_ent[[1, 2]].isnan().all())  # the plain path's answer


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("vocab", [50, 20000], ids=["one-chunk", "overflowing"])  # fused: select vs whole-row path
@pytest.mark.parametrize("filt", FILTERS + [pytest.param("k=V-1", id="top_k-V-1")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("item", [3, 4])
def test_item3_item4_gpu_dead_and_nan_rows_are_nan(item, dtype, filt, vocab, backend):
    _need(backend)
    with _clean_record():
        _check_dead_rows(filt, "cuda", backend, vocab, rows=[0, 5] if item == 3 else [1, 2], dtype=dtype)


# ---- 8: torch.compile with the default backend ---------------------------------------------------------------------

needs_cxx = pytest.mark.skipif(not (shutil.which("g++") or shutil.which("clang++")),
                               reason="inductor on CPU needs a C++ compiler")


@needs_cxx
def test_item8_inductor_on_cpu_is_what_the_contract_says():
    """Contract 1, torch.compile: the native path under the default (inductor) backend is within float32 rounding of
    eager (not bitwise: inductor fuses and reorders the reductions); a seeded draw gives eager's ids; a draw from
    torch's generator gives eager's ids after the same manual_seed only with inductor's fallback_random."""
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(8)
    x = torch.randn(4, 6, 33, generator=g, requires_grad=True)
    ids = torch.randint(0, 33, (4, 6), generator=g)

    def step(x, ids):
        return rlkernel.logp(x, ids, return_entropy=True, temperature=0.7)

    lp_c, ent_c = torch.compile(step, fullgraph=True)(x, ids)
    (lp_c.sum() + ent_c.sum()).backward()
    grad_c, x.grad = x.grad.clone(), None
    lp, ent = step(x, ids)
    (lp.sum() + ent.sum()).backward()
    for got, want in ((lp_c, lp), (ent_c, ent), (grad_c, x.grad)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    rows = torch.randn(64, 40, generator=g)
    kw = dict(top_k=5, top_p=0.9, temperature=0.8, return_logprobs=True)
    ids_c, tlp_c = torch.compile(lambda r: rlkernel.sample(r, seed=7, offset=3, **kw), fullgraph=True)(rows)
    ids_e, tlp_e = rlkernel.sample(rows, seed=7, offset=3, **kw)
    assert torch.equal(ids_c, ids_e)
    torch.testing.assert_close(tlp_c, tlp_e, atol=1e-5, rtol=1e-5)

    def draw(r):
        return rlkernel.sample(r, **kw)

    torch.manual_seed(11)
    ids_c, _ = torch.compile(draw, fullgraph=True)(rows)
    kept = rows.topk(5, dim=-1).indices
    assert bool((ids_c.unsqueeze(-1) == kept).any(-1).all()), "inductor's own noise must still draw from the kept set"
    torch._dynamo.reset()
    with inductor_config.patch(fallback_random=True):
        torch.manual_seed(11)
        ids_c, _ = torch.compile(draw, fullgraph=True)(rows)
    torch.manual_seed(11)
    ids_e, _ = draw(rows)
    assert torch.equal(ids_c, ids_e)
    torch._dynamo.reset()


# ---- 9: double backward ---------------------------------------------------------------------------------------------

SECOND_ORDER = "second derivatives are not supported"


def _second_order_refused(out, x, op):
    """d out / d x with create_graph=True, then a Hessian-vector product: must raise, naming the op. Returns the
    first-order gradient (so it can be compared with the one taken without create_graph)."""
    (g,) = torch.autograd.grad(out, x, create_graph=True)
    v = torch.randn(g.shape, dtype=g.dtype, generator=torch.Generator().manual_seed(9)).to(g.device)
    with pytest.raises(RuntimeError, match=rf"{op}: {SECOND_ORDER}"):
        torch.autograd.grad((g * v).sum(), x, retain_graph=True)  # kept for the next try
    with pytest.raises(RuntimeError, match=rf"{op}: {SECOND_ORDER}"):  # mixed with a differentiable term: no drop
        torch.autograd.grad((g * g).sum() + (x * x).sum(), x)
    return g.detach()


def _logp_cases(device, backend, dtype):
    x = torch.randn(3, 6, dtype=dtype, generator=torch.Generator().manual_seed(1)).to(device)
    x[0, 2] = NINF  # the row whose entropy HVP was NaN
    ids = torch.tensor([1, 2, 3], device=device)
    return [("logp.backward", x, lambda t: rlkernel.logp(t, ids, return_entropy=True, backend=backend)[1].sum()),
            ("logp.backward", x, lambda t: rlkernel.logp(t, ids, return_entropy=True, top_k=4,
                                                        backend=backend)[1].sum()),
            ("logp.backward", x, lambda t: rlkernel.logp(t, ids, backend=backend).sum())]


def _linear_cases(device, backend, dtype):
    g = torch.Generator().manual_seed(2)
    h = torch.randn(3, 4, dtype=dtype, generator=g).to(device)
    w = torch.randn(5, 4, dtype=dtype, generator=g).to(device)
    ids = torch.tensor([1, 2, 3], device=device)
    return [("linear_logp.backward", h, lambda t: rlkernel.linear_logp(
                t, w, ids, return_entropy=True, batch_invariant=True, backend=backend)[1].sum()),
            ("linear_logp.backward", h, lambda t: rlkernel.linear_logp(t, w, ids, backend=backend).sum()),
            ("linear_logp_loss", h, lambda t: rlkernel.linear_logp_loss(
                t, w, ids, lambda lp, ent, s: -lp - 0.1 * ent, backend=backend))]


def _check_double_backward(device, backend, dtype):
    for op, x0, f in _logp_cases(device, backend, dtype) + _linear_cases(device, backend, dtype):
        for upstream in (False, True):  # the op's input itself, or a parameter behind it (as in a model)
            x = x0.clone().requires_grad_(True)
            g = _second_order_refused(f(x * 1.5 if upstream else x), x, op)
            (plain,) = torch.autograd.grad(f(x * 1.5 if upstream else x), x)
            assert torch.equal(g, plain), f"{op}: create_graph=True changed the first-order gradient"


def test_item9_double_backward_is_refused_naming_the_op():
    _check_double_backward("cpu", "auto", torch.float64)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
def test_item9_gpu_double_backward_is_refused_naming_the_op(backend):
    _need(backend)
    with _clean_record():
        _check_double_backward("cuda", backend, torch.float32)


# ---- 10: uint64 ids --------------------------------------------------------------------------------------------------

def test_item10_uint64_token_ids_are_refused():
    ids = torch.tensor([2**64 - 1, 3], dtype=torch.uint64)
    x, h, w = torch.randn(2, 10), torch.randn(2, 4), torch.randn(10, 4)
    calls = [lambda ii: rlkernel.logp(x, ids, ignore_index=ii),
             lambda ii: rlkernel.logp(x, ids, top_k=3, ignore_index=ii),
             lambda ii: rlkernel.linear_logp(h, w, ids, ignore_index=ii),
             lambda ii: rlkernel.linear_logp_loss(h, w, ids, lambda lp, ent, s: -lp, ignore_index=ii)]
    for call in calls:
        for ignore_index in (-100, -1):  # -1: 2^64 - 1 wrapped to it was silently ignored
            rlkernel.dispatch.reset()
            with pytest.raises(TypeError, match="token_ids.*uint64"):
                call(ignore_index)
            assert rlkernel.dispatch.history() == [], "refused before any dispatch record"
    with pytest.raises(TypeError, match="top_k.*uint64"):  # a per-row top_k of 2^64 - 1 wrapped to -1 too
        rlkernel.sample(x, top_k=torch.tensor([2**64 - 1, 3], dtype=torch.uint64))
    # uint8/16/32 ids fit in int64: still fine
    assert torch.equal(rlkernel.logp(x, ids.to(torch.int64).clamp(0, 9).to(torch.uint32)),
                       rlkernel.logp(x, ids.to(torch.int64).clamp(0, 9)))


# ---- 21: hidden size 0 ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("op", ["linear_logp.forward", "linear_logp_loss"])
def test_item21_hidden_size_zero_is_refused_before_any_work(op, with_bias):
    h, w, ids = torch.randn(4, 0), torch.randn(5, 0), torch.tensor([0, 1, 2, 3])
    bias = torch.randn(5) if with_bias else None
    with pytest.raises(ValueError, match=rf"{op}: hidden size 0"):
        if op == "linear_logp_loss":
            rlkernel.linear_logp_loss(h, w, ids, lambda lp, ent, s: -lp, bias=bias)
        else:
            rlkernel.linear_logp(h, w, ids, bias=bias)
    assert rlkernel.dispatch.history() == [], "refused before any dispatch record"


# ---- decision: a float64 per-row temperature that rounds to 0 in float32 ------------------------------------------

def test_decision_float64_temperature_underflowing_float32_is_refused():
    x = torch.randn(3, 10, generator=torch.Generator().manual_seed(5))
    t = torch.tensor([1.0, 1e-300, 0.0], dtype=torch.float64)  # row 1: > 0, but 0 in float32; row 2: a true 0
    with pytest.raises(ValueError, match=r"sample: temperature of row 1 is out of range \(1e-300\)"):
        rlkernel.sample(x, temperature=t)
    with pytest.raises(ValueError, match=r"logp.forward: temperature of row 1 is out of range \(1e-300\)"):
        rlkernel.logp(x, torch.zeros(3, dtype=torch.int64), temperature=t)
    with pytest.raises(ValueError, match="too small"):  # the same number as a Python float: refused as before
        rlkernel.sample(x, temperature=1e-300)
    ok = torch.tensor([1.0, 1e-30, 0.0], dtype=torch.float64)  # 1e-30: a tiny but valid float32 temperature
    assert rlkernel.sample(x, temperature=ok, seed=1).tolist()[1:] == x.argmax(-1).tolist()[1:]


def test_temperature_whose_scale_is_not_a_normal_float32_is_refused():
    """log2(e) / T below float32's smallest normal number: the kernels flush it to 0 (every logit times 0, a -inf
    padding column NaN), so such a T is refused before any work, as one whose scale overflows is."""
    x = torch.randn(3, 10, generator=torch.Generator().manual_seed(6))
    ids = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"temperature 1e\+39 is too large"):
        rlkernel.logp(x, ids, temperature=1e39)
    with pytest.raises(ValueError, match="too large"):
        rlkernel.sample(x, temperature=1e39)
    with pytest.raises(ValueError, match="too large"):
        rlkernel.linear_logp(torch.randn(3, 4), torch.randn(10, 4), ids, temperature=1e39)
    assert rlkernel.logp(x, ids, temperature=1e30).isfinite().all()  # 1.4e-30: a normal float32 scale


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
def test_decision_gpu_float64_temperature_underflow_goes_to_the_record(backend):
    _need(backend)
    x = torch.randn(3, 1000, device="cuda")
    t = torch.tensor([1.0, 1e-300, 0.0], dtype=torch.float64, device="cuda")
    with _clean_record():
        ids = rlkernel.sample(x, temperature=t, seed=3, backend=backend)
        with pytest.raises(ValueError, match="sample: temperature of row 1 is out of range"):
            rlkernel.check_errors()
        assert ids[1].item() == -1 and ids[2].item() == int(x[2].argmax())
        lp = rlkernel.logp(x, torch.zeros(3, dtype=torch.int64, device="cuda"), temperature=t, backend=backend)
        with pytest.raises(ValueError, match="logp.forward: temperature of row 1 is out of range"):
            rlkernel.check_errors()
        assert torch.isnan(lp[1]) and not torch.isnan(lp[[0, 2]]).any()
