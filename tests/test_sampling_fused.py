"""The fused sampler (CUDA): the exact filtered law, kept sets at real vocabulary sizes, reproducibility,
log-probs equal to rlkernel.logp (bitwise, or within the contract's bound on the candidates path), the generator
contract (offsets, CUDA graphs), torch.compile, bad rows."""

import pytest
import torch
from raw_logprobs import assert_raw_logprobs
from reference import chi_square_pvalue, filtered_distribution

import rlkernel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DRAWS = 40000  # rows of one call: the sampler draws each row independently


def _fused_ready():
    from rlkernel import _ext

    return _ext.unavailable_reason() is None and _ext.has_op("sample")


@pytest.fixture(autouse=True)
def _need_fused():
    # Not a skip: on a CUDA machine these tests need the built extension (MAX_JOBS=2 python setup.py build_ext
    # --inplace); a missing build must not pass as "skipped"
    assert _fused_ready(), "rlkernel._C is not built (or lacks the sample op): python setup.py build_ext --inplace"


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def _row(kind, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "randn":
        return torch.randn(vocab, generator=g) * 2
    if kind == "ties":  # few levels: ties everywhere, also at the top-k and top-p boundaries
        return torch.randint(0, 6, (vocab,), generator=g).float() * 0.7
    if kind == "neginf":  # most of the row -inf, plus ties among the finite ones
        row = torch.full((vocab,), float("-inf"))
        idx = torch.randperm(vocab, generator=g)[:60]
        row[idx] = torch.randn(60, generator=g)
        row[idx[:6]] = row[idx[6]].item()
        return row
    if kind == "flat":  # every token equal: every chunk overflows its candidates, the whole-row path runs
        return torch.full((vocab,), 0.25)
    raise ValueError(kind)


def _boundary_margin(row, temperature, top_k, top_p):
    """Distance of top_p from the nearest prefix mass of the kept top-k set (float64)."""
    if temperature == 0 or top_p >= 1:
        return 1.0
    p = torch.softmax(row.double() / temperature, -1)
    sp, _ = torch.sort(p, descending=True, stable=True)
    if 0 < top_k < p.numel():
        sp = sp[:top_k]
    c = torch.cumsum(sp / sp.sum(), 0)
    return float((c - top_p).abs().min())


# (kind, vocab, top_k, top_p, temperature): every axis of the issue covered, not the whole product. V = 10000
# spans two 8192-token chunks of the fast path, V = 8200 ends in a chunk of 8 tokens (fewer than k: all kept);
# top_k 0, V and 200 (> 128) take the whole-row path.
LAW_CASES = [
    ("randn", 1000, 50, 0.9, 1.0), ("randn", 1000, 5, 1.0, 0.6), ("randn", 1000, 1, 1.0, 1.0),
    ("randn", 1000, 0, 0.9, 0.6), ("randn", 1000, 1000, 0.1, 1.0), ("randn", 1000, 0, 1.0, 1.0),
    ("randn", 1000, 200, 0.9, 1.0), ("randn", 1000, 50, 0.1, 0.6), ("randn", 1000, 5, 0.9, 0.0),
    ("ties", 1000, 50, 0.89, 1.0), ("ties", 1000, 5, 1.0, 0.6), ("ties", 1000, 0, 0.1, 1.0),
    ("ties", 1000, 50, 0.5, 0.0), ("neginf", 1000, 50, 0.9, 1.0), ("neginf", 1000, 0, 1.0, 0.6),
    ("neginf", 1000, 5, 0.9, 1.0), ("randn", 10000, 50, 0.9, 1.0), ("ties", 10000, 50, 0.89, 0.6),
    ("flat", 10000, 50, 1.0, 1.0), ("flat", 10000, 0, 0.10005, 1.0), ("randn", 37, 50, 1.0, 1.0),
    ("randn", 8200, 50, 0.9, 1.0),
]


@pytest.mark.parametrize("kind,vocab,top_k,top_p,temperature", LAW_CASES)
def test_law_matches_exact_filtered_distribution(kind, vocab, top_k, top_p, temperature):
    row = _row(kind, vocab, seed=vocab + top_k)
    # the kernel keeps masses in 2^-40 fixed point from float32 exp (relative error ~1e-6): a top_p within 1e-5
    # of a prefix mass could legitimately land on either side, so such inputs are not a test of the law
    assert _boundary_margin(row, temperature, top_k, top_p) > 1e-5
    logits = row.cuda().expand(DRAWS, vocab)
    ids = rlkernel.sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=_gen(7),
                          backend="fused")
    probs = filtered_distribution(row, temperature, top_k, top_p)
    counts = torch.bincount(ids.cpu(), minlength=vocab).double()
    assert counts.sum() == DRAWS
    assert torch.all(counts[probs == 0] == 0), f"drew outside the kept set: {counts[probs == 0].nonzero()[:5]}"
    if int((probs > 0).sum()) == 1:
        return  # a single kept token: every draw is it (checked just above)
    # p-value threshold 1e-5: a correct sampler fails one such case in 100,000; the seeds are fixed
    assert chi_square_pvalue(counts, probs) > 1e-5


def _kept_mask(logits, temperature, top_k, top_p, slack):
    """Rows of the kept set in float64 (ties by lower id), with top_p widened by ``slack`` (see the caller)."""
    x = logits.double()
    p = torch.softmax(x / (temperature if temperature > 0 else 1.0), -1)
    sp, order = torch.sort(p, dim=-1, descending=True, stable=True)
    keep = torch.ones_like(sp, dtype=torch.bool)
    if 0 < top_k < p.shape[-1]:
        keep[:, top_k:] = False
    sp = torch.where(keep, sp, torch.zeros_like(sp))
    q = sp / sp.sum(-1, keepdim=True)
    before = torch.cumsum(q, -1) - q
    if top_p < 1:
        keep &= before < min(top_p + slack, 1.0)
    return torch.zeros_like(keep).scatter_(-1, order, keep)


BIG_CASES = [  # (vocab, dtype, batch, top_k, top_p, temperature)
    (32000, torch.float32, 256, 50, 0.9, 1.0), (32000, torch.bfloat16, 3, 0, 0.9, 0.7),
    (128256, torch.float32, 1, 50, 0.9, 1.0), (128256, torch.bfloat16, 256, 50, 0.9, 0.6),
    (128256, torch.float16, 3, 128, 0.95, 1.0), (151936, torch.float16, 256, 20, 0.8, 1.0),
    (151936, torch.float32, 3, 0, 1.0, 1.0), (151936, torch.bfloat16, 1, 50, 1.0, 0.0),
]


@pytest.mark.parametrize("vocab,dtype,batch,top_k,top_p,temperature", BIG_CASES)
def test_large_vocab_kept_set_reproducible_and_logprobs_bitwise(vocab, dtype, batch, top_k, top_p, temperature):
    g = torch.Generator(device="cuda").manual_seed(vocab + batch)
    logits = (torch.randn(batch, vocab, device="cuda", generator=g) * 3).to(dtype)
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, backend="fused")
    ids, lp = rlkernel.sample(logits, generator=_gen(11), return_logprobs=True, **kw)
    assert ids.shape == (batch,) and ids.dtype == torch.int64 and lp.dtype == torch.float32
    # slack 1e-4 on top_p: the kernel's masses (float32 exp, 2^-40 fixed point) may put a token that sits on the
    # top_p boundary within 1e-4 on the other side than float64 does; top-k and ties are exact
    kept = _kept_mask(logits.float(), temperature, top_k, top_p, slack=1e-4)
    if temperature == 0:
        kept = torch.zeros_like(kept).scatter_(-1, logits.float().argmax(-1, keepdim=True), True)
    inside = kept.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    assert bool(inside.all()), f"rows {(~inside).nonzero().flatten()[:5].tolist()} drew outside the kept set"
    again = rlkernel.sample(logits, generator=_gen(11), **kw)
    assert torch.equal(ids, again), "same seed, different ids"
    # from the sampler's own pass: bit for bit on the whole-row path (k = 0 or > 128, T > 0), within the contract's
    # bound on the candidates path (docs/contracts.md, section 1; tests/raw_logprobs.py)
    assert_raw_logprobs(lp, logits, ids, temperature, bitwise=temperature > 0 and not 1 <= top_k <= 128)
    if temperature > 0 and batch == 256:
        other = rlkernel.sample(logits, generator=_gen(12), **kw)
        assert not torch.equal(ids, other), "another seed drew the same 256 ids"


def _drifting_row(shape, vocab, g):
    """Logits whose level drifts along the vocabulary: a chunk's own bound is far from another chunk's."""
    t = torch.arange(vocab, dtype=torch.float64) / vocab
    level = {"rising": 4 * t, "falling": 4 * (1 - t), "bump": 4 * torch.exp(-(((t - 0.45) / 0.05) ** 2))}[shape]
    return (level + 0.4 * torch.randn(vocab, generator=g, dtype=torch.float64)).float()


@pytest.mark.parametrize("shape", ["rising", "falling", "bump"])
def test_rows_drifting_along_the_vocab_keep_their_exact_top_k(shape):
    # The candidates kernel filters a chunk with a bound certified on an earlier chunk of the same row when it
    # has one (and searches its own when that keeps too many): rows whose level drifts make the two differ.
    vocab = 128256
    row = _drifting_row(shape, vocab, torch.Generator().manual_seed(len(shape)))
    draws = 4096  # identical rows: the blocks' chunk ranges start at every split of the row
    ids = rlkernel.sample(row.cuda().expand(draws, vocab), top_k=50, top_p=1.0, generator=_gen(13), backend="fused")
    probs = filtered_distribution(row, 1.0, 50, 1.0)
    counts = torch.bincount(ids.cpu(), minlength=vocab).double()
    assert torch.all(counts[probs == 0] == 0), f"drew outside the top 50: {counts[probs == 0].nonzero()[:5]}"
    assert chi_square_pvalue(counts, probs) > 1e-5
    g = torch.Generator().manual_seed(99)
    rows = torch.stack([_drifting_row(shape, vocab, g) for _ in range(256)]).cuda()
    for temperature in (0.0, 1.0):  # top-1 at any temperature is the first maximal id
        got = rlkernel.sample(rows, temperature=temperature, top_k=1, generator=_gen(1), backend="fused")
        assert torch.equal(got, rows.argmax(-1))


@pytest.mark.parametrize("n_tied", [60, 200])
def test_ties_at_the_kth_key_keep_the_lowest_ids(n_tied):
    # 20 distinct top logits, then n_tied tokens sharing the 21st value, spread over the row's chunks, so the top 50
    # ends inside the tie: select's threshold lands on the tied key and keeps 20 + n_tied candidates, ranked when
    # they are at most 128 (60), handed to the sort of every candidate when they are more (200).
    vocab, g = 128256, torch.Generator().manual_seed(n_tied)
    row = torch.randn(vocab, generator=g) * 0.5
    where = torch.randperm(vocab, generator=g)[: 20 + n_tied]
    row[where[:20]] = 5.1 + 0.9 * torch.rand(20, generator=g)
    row[where[20:]] = 5.0
    draws = 4096  # identical rows: the blocks' chunk ranges start at every split of the row
    ids = rlkernel.sample(row.cuda().expand(draws, vocab), top_k=50, top_p=1.0, generator=_gen(17), backend="fused")
    probs = filtered_distribution(row, 1.0, 50, 1.0)
    assert int((probs > 0).sum()) == 50
    counts = torch.bincount(ids.cpu(), minlength=vocab).double()
    assert torch.all(counts[probs == 0] == 0), f"drew outside the top 50: {counts[probs == 0].nonzero()[:5]}"
    assert chi_square_pvalue(counts, probs) > 1e-5


def test_generator_offset_advances_and_default_generator_is_used():
    logits = torch.randn(64, 5000, device="cuda")
    g = _gen(3)
    before = g.get_offset()
    a = rlkernel.sample(logits, top_k=50, generator=g, backend="fused")
    assert g.get_offset() > before, "the call did not advance the generator"
    b = rlkernel.sample(logits, top_k=50, generator=g, backend="fused")
    assert not torch.equal(a, b), "two calls on one generator drew the same 64 ids"
    torch.cuda.manual_seed(5)
    c = rlkernel.sample(logits, top_k=50, backend="fused")
    torch.cuda.manual_seed(5)
    assert torch.equal(c, rlkernel.sample(logits, top_k=50, backend="fused"))
    g0 = _gen(9)
    off = g0.get_offset()
    rlkernel.sample(logits, temperature=0, generator=g0, backend="fused")
    assert g0.get_offset() == off, "argmax (T = 0) draws nothing and must not advance the generator"


def test_cuda_graph_replays_draw_afresh_inside_the_kept_set():
    logits = torch.randn(256, 32000, device="cuda")
    kept = _kept_mask(logits, 1.0, 50, 0.9, slack=1e-4)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (registration, allocator) outside the capture
        rlkernel.sample(logits, top_k=50, top_p=0.9, backend="fused")
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids = rlkernel.sample(logits, top_k=50, top_p=0.9, backend="fused")
    graph.replay()
    first = ids.clone()
    graph.replay()
    second = ids.clone()
    assert not torch.equal(first, second), "replays reused the captured random numbers"
    for drawn in (first, second):
        assert bool(kept.gather(-1, drawn.unsqueeze(-1)).all())


def test_torch_compile_without_graph_break():
    from rlkernel.ops.fused.sampling import sample_fused

    logits = torch.randn(8, 4000, device="cuda")

    def f(x):
        ids, _ = sample_fused(x * 2.0, temperature=0.0, top_k=0, top_p=1.0, generator=None, return_logprobs=False)
        return ids

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True)(logits)  # fullgraph: a graph break is an error
    assert torch.equal(got, (logits * 2.0).argmax(-1))


def test_strided_and_misaligned_rows_match_contiguous():
    wide = torch.randn(5, 3, 40001, device="cuda", dtype=torch.bfloat16)
    view = wide[..., 1:40000]  # row stride 40001, rows start off any vector alignment
    a = rlkernel.sample(view, top_k=50, top_p=0.9, generator=_gen(4), backend="fused")
    b = rlkernel.sample(view.contiguous(), top_k=50, top_p=0.9, generator=_gen(4), backend="fused")
    assert a.shape == (5, 3) and torch.equal(a, b)


def test_rows_without_distribution_are_reported_at_any_temperature():
    # contracts, section 1: a NaN or no finite logit is a row without a distribution, greedy or not: id -1, and
    # the device error record names the row
    rlkernel.check_errors()
    logits = torch.randn(4, 3000, device="cuda")
    ids = rlkernel.sample(logits, temperature=0, backend="fused")
    assert torch.equal(ids, logits.argmax(-1))  # lowest id among ties, as torch.argmax
    logits[2] = float("-inf")
    for t in (0.0, 1.0):
        assert rlkernel.sample(logits, temperature=t, top_k=50, backend="fused")[2].item() == -1
        with pytest.raises(ValueError, match="row 2"):
            rlkernel.check_errors()
    logits[2] = 0.0
    logits[1, 17] = float("nan")
    for t in (0.0, 1.0):
        assert rlkernel.sample(logits, temperature=t, backend="fused")[1].item() == -1
        with pytest.raises(ValueError, match="row 1"):
            rlkernel.check_errors()


def test_dispatch_records_fused_and_empty_input():
    with rlkernel.dispatch.recording() as rec:
        rlkernel.sample(torch.randn(2, 100, device="cuda"), top_k=5, backend="auto")
    assert [(r.op, r.status) for r, _ in rec.records] == [("sample", "fused")]
    out = rlkernel.sample(torch.randn(0, 100, device="cuda"), backend="fused")
    assert out.shape == (0,)
