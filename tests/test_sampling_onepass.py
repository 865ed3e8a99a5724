"""rlkernel.sample(..., return_logprobs="processed") out of the sampler's own pass (issue 38; CUDA): the log-probs
bitwise rlkernel.logp's with the same filters (per-row mixes, T = 0 rows, k >= V, tiny top_p, ties and top-p /
min-p boundaries, every dtype, the candidates path and the whole-row path), the same ids as a draw without
log-probs, the sampler's kernels alone (no logp kernel), no host sync, CUDA-graph replays with device seeds and
offsets, and the error record for bad per-row values."""
import contextlib
import math

import pytest
import torch
from cuda_graphs import sampler_replays_against_eager, warm_on_side_stream

import rlkernel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _need_fused_and_a_clean_record():
    from rlkernel import _ext

    # not a skip: on a CUDA machine these tests need the build (python setup.py build_ext --inplace)
    assert _ext.unavailable_reason() is None and _ext.has_op("sample_processed"), _ext.unavailable_reason()
    rlkernel.check_errors()
    yield
    with contextlib.suppress(IndexError, ValueError):
        rlkernel.check_errors()


def _kw(settings):
    t, k, p, m = zip(*settings, strict=True)
    f32 = dict(dtype=torch.float32, device="cuda")
    return dict(temperature=torch.tensor(t, **f32), top_k=torch.tensor(k, dtype=torch.int64, device="cuda"),
                top_p=torch.tensor(p, **f32), min_p=torch.tensor(m, **f32))


def _bits(x):
    return x.view(torch.int32)


def _mixed_settings(n, vocab, seed):
    """Per-row (T, k, p, min_p): T = 0 rows, k = 0, small k (the candidates path), large k and k >= V (the whole-row
    path), tiny top_p (only the top token), min_p."""
    g = torch.Generator().manual_seed(seed)
    ts, ks = (0.0, 0.5, 1.0, 1.7), (0, 1, 7, 50, 128, 129, 300, vocab, vocab + 11)
    ps, ms = (1e-7, 0.3, 0.9, 1.0), (0.0, 0.05, 0.3, 1.0)
    pick = lambda seq: seq[int(torch.randint(len(seq), (), generator=g))]  # noqa: E731
    return [(pick(ts), pick(ks), pick(ps), pick(ms)) for _ in range(n)]


def _assert_one_pass_equals_logp(x, settings_kw, **noise):
    """The processed draw gives the plain draw's ids and, bit for bit, rlkernel.logp's processed log-probs."""
    ids, lp = rlkernel.sample(x, return_logprobs="processed", backend="fused", **settings_kw, **noise)
    assert lp.dtype == torch.float32 and lp.shape == ids.shape == x.shape[:-1]
    assert torch.equal(ids, rlkernel.sample(x, backend="fused", **settings_kw, **noise)), "the draw changed"
    want = rlkernel.logp(x, ids, backend="fused", **settings_kw)
    differ = (_bits(lp) != _bits(want)).nonzero()
    assert differ.numel() == 0, (f"row {int(differ[0])}: sampler {float(lp.flatten()[differ[0]])!r}, "
                                 f"logp {float(want.flatten()[differ[0]])!r}")
    return ids, lp


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [128256, 5003, 40])
def test_per_row_mixes_equal_logp_bitwise(dtype, vocab):
    g = torch.Generator(device="cuda").manual_seed(vocab)
    x = (torch.randn(96, vocab, device="cuda", generator=g) * 3).to(dtype)
    settings = _mixed_settings(96, vocab, seed=vocab)
    seeds = torch.arange(96, device="cuda") * 7919 + 5
    ids, lp = _assert_one_pass_equals_logp(x, _kw(settings), seed=seeds, offset=torch.arange(96, device="cuda"))
    for r, (t, _, p, _) in enumerate(settings):
        if t == 0 or p == 1e-7:  # one token kept (the first of any tie at the top): log-prob 0 (T = 0) or ~0
            assert abs(float(lp[r])) <= (0.0 if t == 0 else 1e-6), f"row {r} {settings[r]}: {float(lp[r])}"
    assert bool(torch.isfinite(lp).all()) and bool((lp <= 1e-6).all())


SCALAR_CASES = [
    dict(temperature=1.0, top_k=50, top_p=0.9),               # the candidates path (the benchmark's settings)
    dict(temperature=0.7, top_k=0, top_p=0.9, min_p=0.05),    # the whole-row path
    dict(temperature=1.3, top_k=128, min_p=0.3),              # the largest fast k
    dict(temperature=1.0, top_k=129, top_p=0.95),             # just past it: whole row
    dict(temperature=0.0),                                    # argmax
    dict(temperature=1.0, top_k=1),
    dict(temperature=1.0, top_p=1e-7),                        # tiny top_p: only the top token
    dict(temperature=0.9, min_p=1.0),                         # only the tokens tied at the top
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(SCALAR_CASES)))
def test_scalar_settings_equal_logp_bitwise(dtype, case):
    kw = SCALAR_CASES[case]
    g = torch.Generator(device="cuda").manual_seed(case)
    x = (torch.randn(33, 128256, device="cuda", generator=g) * 4).to(dtype)
    _assert_one_pass_equals_logp(x, kw, seed=123, offset=4)
    gen = torch.Generator(device="cuda")
    ids, lp = rlkernel.sample(x, return_logprobs="processed", backend="fused", generator=gen.manual_seed(9), **kw)
    assert torch.equal(ids, rlkernel.sample(x, backend="fused", generator=gen.manual_seed(9), **kw))
    assert torch.equal(_bits(lp), _bits(rlkernel.logp(x, ids, backend="fused", **kw)))


@pytest.mark.parametrize("kw", [dict(temperature=0.8), dict(temperature=1.0, top_k=128256)],
                         ids=["no-filter", "k=V"])
def test_unfiltered_processed_is_the_plain_logp(kw):
    # no filter: the processed law is softmax(x / T), and rlkernel.logp takes its plain kernel; so does sample
    x = torch.randn(16, 128256, device="cuda", dtype=torch.bfloat16) * 3
    ids, lp = rlkernel.sample(x, return_logprobs="processed", backend="fused", seed=3, **kw)
    assert torch.equal(_bits(lp), _bits(rlkernel.logp(x, ids, backend="fused", **kw)))
    _, raw = rlkernel.sample(x, return_logprobs=True, backend="fused", seed=3, **kw)
    assert torch.equal(_bits(lp), _bits(raw))


def _tie_rows(vocab, g):
    """Rows whose kept sets are decided on ties and boundaries (float32, CPU)."""
    rows = []
    x = torch.zeros(vocab)  # every token tied: the candidates overflow, the whole-row path decides by id
    rows.append(x)
    x = torch.randn(vocab, generator=g)
    x[torch.randperm(vocab, generator=g)[:600]] = 5.0  # 600 tied at the top: more than the candidates a row keeps
    rows.append(x)
    x = torch.randn(vocab, generator=g)
    x[torch.randperm(vocab, generator=g)[:300]] = 4.0  # 300 tied at the top: k = 50 cuts inside the tie
    rows.append(x)
    x = (torch.randn(vocab, generator=g) * 2).round()  # a few distinct values, thousands of ties each
    rows.append(x)
    x = torch.full((vocab,), -30.0)
    x[:2] = 0.0  # two tokens of mass 1/2 each: top_p = 0.5 stops exactly at the first (the boundary)
    rows.append(x)
    x = torch.full((vocab,), -30.0)
    x[0], x[1] = 0.0, math.log(0.25)  # min_p = 0.25: token 1 sits on the min_p floor
    rows.append(x)
    x = torch.randn(vocab, generator=g)
    x[torch.randperm(vocab, generator=g)[: vocab // 3]] = float("-inf")  # -inf entries: probability 0
    rows.append(x)
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [128256, 9000])
def test_ties_and_boundaries_equal_logp_bitwise(dtype, vocab):
    base = _tie_rows(vocab, torch.Generator().manual_seed(vocab))
    grid = [(1.0, 50, 1.0, 0.0), (1.0, 50, 0.5, 0.0), (1.0, 0, 0.5, 0.25), (1.0, 128, 0.9, 0.25), (0.0, 0, 1.0, 0.0),
            (1.0, 1, 1.0, 0.0), (0.7, vocab, 0.3, 0.0), (1.0, 0, 1.0, 0.25)]
    x = base.repeat_interleave(len(grid), 0).to(dtype).cuda()
    settings = grid * base.shape[0]
    n = x.shape[0]
    _assert_one_pass_equals_logp(x, _kw(settings), seed=torch.arange(n, device="cuda"), offset=7)


def test_rows_without_a_distribution_and_infinite_argmax_match_logp():
    x = torch.randn(6, 20000, device="cuda")
    x[1] = float("-inf")        # no distribution
    x[2, 77] = float("nan")     # no distribution
    x[3, 5] = float("inf")      # T > 0: no distribution
    x[4, 9] = float("inf")      # T = 0 (below): the argmax
    settings = [(1.0, 50, 0.9, 0.0), (1.0, 50, 0.9, 0.0), (0.0, 0, 1.0, 0.0), (1.0, 0, 0.9, 0.0),
                (0.0, 0, 1.0, 0.0), (0.8, 0, 1.0, 0.1)]
    kw = _kw(settings)
    ids, lp = rlkernel.sample(x, return_logprobs="processed", backend="fused", seed=1, **kw)
    assert ids[1] == -1 and ids[2] == -1 and ids[3] == -1 and ids[4] == 9
    assert bool(torch.isnan(lp[1:4]).all()) and bool(torch.isfinite(lp[torch.tensor([0, 5])]).all())
    with pytest.raises(ValueError, match="row 1"):
        rlkernel.check_errors()
    want = rlkernel.logp(x, ids, backend="fused", **kw)  # (it reports the -1 ids too: the fixture clears them)
    assert torch.equal(_bits(lp), _bits(want))  # NaN rows included: the same NaN, and row 4's inf - inf


def test_only_the_samplers_kernels_run():
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(256, 128256, device="cuda", dtype=torch.bfloat16)
    cases = {"candidates path": dict(temperature=1.0, top_k=50, top_p=0.9),
             "whole-row path": dict(temperature=1.0, top_p=0.9),
             "per-row": _kw(_mixed_settings(256, 128256, seed=1))}
    for name, kw in cases.items():
        rlkernel.sample(x, return_logprobs="processed", backend="fused", seed=2, **kw)  # warm
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            rlkernel.sample(x, return_logprobs="processed", backend="fused", seed=2, **kw)
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert kernels, name
        assert all("rlkernel_sample_" in k for k in kernels), f"{name}: {kernels}"
        finals = [k for k in kernels if "rlkernel_sample_select" in k or "rlkernel_sample_rows" in k]
        assert len(finals) == 1, f"{name}: one pass, one final kernel: {kernels}"


def test_no_host_sync():
    x = torch.randn(48, 128256, device="cuda", dtype=torch.bfloat16) * 3
    kw = _kw(_mixed_settings(48, 128256, seed=6))
    seeds, offsets = torch.arange(48, device="cuda"), torch.arange(48, device="cuda") * 3
    rlkernel.sample(x, seed=seeds, offset=offsets, return_logprobs="processed", backend="fused", **kw)  # warm
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ids, lp = rlkernel.sample(x, seed=seeds, offset=offsets, return_logprobs="processed", backend="fused", **kw)
        ids2, lp2 = rlkernel.sample(x, top_k=50, top_p=0.9, return_logprobs="processed", backend="fused")
        ids3, lp3 = rlkernel.sample(x, temperature=0.0, return_logprobs="processed", backend="fused")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.equal(_bits(lp), _bits(rlkernel.logp(x, ids, backend="fused", **kw)))
    assert torch.equal(_bits(lp2), _bits(rlkernel.logp(x, ids2, top_k=50, top_p=0.9, backend="fused")))
    assert torch.equal(ids3, x.float().argmax(-1)) and bool((lp3 == 0).all())


def test_cuda_graph_replays_follow_device_seeds_and_offsets():
    x = torch.randn(256, 128256, device="cuda") * 2
    kw = _kw(_mixed_settings(256, 128256, seed=4))
    for g_ids, g_lp, want_lp in sampler_replays_against_eager(x, kw, "processed"):
        assert torch.equal(_bits(g_lp), _bits(want_lp))
        assert torch.equal(_bits(g_lp), _bits(rlkernel.logp(x, g_ids, backend="fused", **kw)))


def test_cuda_graph_replays_with_a_registered_generator():
    x = torch.randn(64, 128256, device="cuda", dtype=torch.bfloat16) * 3
    gen = torch.Generator(device="cuda").manual_seed(0)

    def call():
        return rlkernel.sample(x, top_k=50, top_p=0.9, generator=gen, return_logprobs="processed", backend="fused")

    warm_on_side_stream(call)
    graph = torch.cuda.CUDAGraph()
    graph.register_generator_state(gen)
    with torch.cuda.graph(graph):
        ids, lp = call()
    gen.manual_seed(21)
    got = []
    for _ in range(2):
        graph.replay()
        got.append((ids.clone(), lp.clone()))
    gen.manual_seed(21)
    for g_ids, g_lp in got:
        want, want_lp = call()
        assert torch.equal(g_ids, want) and torch.equal(_bits(g_lp), _bits(want_lp))
        assert torch.equal(_bits(g_lp), _bits(rlkernel.logp(x, g_ids, top_k=50, top_p=0.9, backend="fused")))
    assert not torch.equal(got[0][0], got[1][0])


@pytest.mark.parametrize("argument,value", [("temperature", -1.0), ("temperature", float("nan")), ("top_k", -3),
                                            ("top_p", 0.0), ("top_p", 1.5), ("min_p", 1.5), ("min_p", -0.1)])
@pytest.mark.parametrize("vocab", [128256, 20000])
def test_bad_per_row_values_reach_the_error_record(argument, value, vocab):
    x = torch.randn(8, vocab, device="cuda")
    kw = _kw([(1.0, 50, 0.9, 0.05)] * 4 + [(0.8, 0, 0.9, 0.0)] * 4)  # both paths around the bad row
    kw[argument][5] = value
    ids, lp = rlkernel.sample(x, seed=1, return_logprobs="processed", backend="fused", **kw)
    with pytest.raises(ValueError, match=rf"{argument}.*row 5"):
        rlkernel.check_errors()
    good = torch.arange(8, device="cuda") != 5
    assert ids[5].item() == -1 and bool((ids[good] >= 0).all())
    assert torch.isnan(lp[5]) and bool(torch.isfinite(lp[good]).all())
    want = rlkernel.logp(x, ids, backend="fused", **kw)
    assert torch.equal(_bits(lp), _bits(want))
    with pytest.raises(ValueError, match=rf"{argument}.*row 5"):
        rlkernel.check_errors()


def test_compiles_without_graph_break():
    from rlkernel.ops.fused.sampling import sample_fused

    x = torch.randn(8, 5000, device="cuda")
    kw = _kw(_mixed_settings(8, 5000, seed=8))
    seeds = torch.arange(8, device="cuda") + 5

    def f(x):
        return sample_fused(x * 2.0, seed=seeds, offset=2, return_logprobs="processed", **kw)

    torch._dynamo.reset()
    ids_c, lp_c = torch.compile(f, fullgraph=True)(x)
    ids, lp = f(x)
    assert torch.equal(ids_c, ids) and torch.equal(_bits(lp_c), _bits(lp))


def test_opcheck():
    # seeded: every run of the op draws the same ids, so opcheck's eager-vs-traced comparisons are exact
    x = torch.randn(16, 5000, device="cuda")
    t = torch.full((16,), 0.8, device="cuda")
    for args in ((x, 0.8, 50, 0.9, None, 0, 0, 0.05, None, None, None, None, True, 7, None, 3, None),
                 (x, 1.0, 0, 1.0, None, 0, 0, 0.0, t, None, None, None, True, 7, None, 3, None)):
        torch.library.opcheck(torch.ops.rlkernel.sample_processed.default, args)
