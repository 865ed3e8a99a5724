"""rlkernel.sample(..., return_logprobs=True) out of the sampler's own pass (issue 38; CUDA): the raw log-probs
within the contract's bound of rlkernel.logp (bit for bit where a row takes the whole-row path with a scalar T), the
same ids as a draw without log-probs, for per-row mixes, T = 0 rows, k >= V, tiny top_p, ties and every dtype; the
sampler's kernels alone (no logp kernel), no host sync, CUDA-graph replays with device seeds and offsets, and the
error record for bad per-row values. The CPU part checks the Python side's call of the op."""
import contextlib

import pytest
import torch
from cuda_graphs import sampler_replays_against_eager
from raw_logprobs import REL, assert_raw_logprobs, raw_bound, raw_temperature
from test_sampling_onepass import _kw, _mixed_settings, _tie_rows

import rlkernel

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ---- CPU: the contract's helpers and the fused call's arguments ----

def test_raw_temperature_replaces_zero_by_one():
    assert raw_temperature(0.0) == 1.0 and raw_temperature(0.7) == 0.7
    t = torch.tensor([0.0, 0.5, 2.0])
    assert torch.equal(raw_temperature(t), torch.tensor([1.0, 0.5, 2.0]))


def test_raw_bound_grows_with_the_scaled_logits():
    x = torch.tensor([[0.0, 1.0, -2.0], [0.0, 100.0, -2.0]])
    ids = torch.tensor([1, 1])
    want = torch.tensor([-0.5, -0.5])
    b = raw_bound(x, ids, torch.tensor([1.0, 0.0]), want)
    assert float(b[0]) == pytest.approx(REL * 1.5 + 2.0 ** -22 * (1 + 2))  # |z_id| + max |z|
    assert float(b[1]) > 100 * 2.0 ** -22  # T = 0: T' = 1, the logits themselves


def test_fused_call_asks_the_op_for_raw_logprobs(monkeypatch):
    """return_logprobs=True calls sample_processed with raw=True (one op, one pass), "processed" with raw=False,
    and no logp function runs after the draw."""
    from rlkernel.ops.fused import sampling as fs

    calls = []

    def fake_processed(*args):
        calls.append(args)
        n = args[0].shape[0]
        return torch.zeros(n, dtype=torch.int64), torch.zeros(n)

    monkeypatch.setattr(fs, "_registered", True)
    monkeypatch.setattr(fs, "_SAMPLE_PROCESSED", fake_processed)
    monkeypatch.setattr(fs, "_SAMPLE_PROCESSED_EAGER", fake_processed)
    monkeypatch.setattr(fs.errors, "begin", lambda *a: (0, 0, None))
    monkeypatch.setattr(fs.errors, "after_call", lambda *a: None)
    assert not hasattr(fs, "logp_fused") and not hasattr(fs, "logp_processed_fused"), "no second kernel to call"
    x = torch.randn(3, 11)
    for mode, raw in ((True, True), ("processed", False)):
        ids, lp = fs.sample_fused(x, temperature=0.8, top_k=5, top_p=0.9, return_logprobs=mode)
        assert calls[-1][-1] is raw and len(calls[-1]) == 18
        assert ids.shape == lp.shape == (3,)


def test_fake_kernel_takes_raw():
    from rlkernel.ops.fused.sampling import _sample_processed_fake

    ids, lp = _sample_processed_fake(torch.empty(4, 9, device="meta"), 1.0, 0, 1.0, raw=True)
    assert ids.shape == lp.shape == (4,) and lp.dtype == torch.float32


# ---- CUDA ----

@pytest.fixture
def _fused_and_a_clean_record():  # (the fixture of test_sampling_onepass, for the CUDA tests below)
    from rlkernel import _ext

    # not a skip: on a CUDA machine these tests need the build (python setup.py build_ext --inplace)
    assert _ext.unavailable_reason() is None and _ext.has_op("sample_processed"), _ext.unavailable_reason()
    rlkernel.check_errors()
    yield
    with contextlib.suppress(IndexError, ValueError):
        rlkernel.check_errors()


def cuda_test(f):
    """A CUDA test: marked gpu, skipped without CUDA, run with the fused build and a clean error record."""
    f = pytest.mark.usefixtures("_fused_and_a_clean_record")(f)
    f = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(f)
    return pytest.mark.gpu(f)


def _assert_raw_draw(x, settings_kw, bitwise=False, **noise):
    """The raw draw gives the plain draw's ids and rlkernel.logp's raw log-probs within the bound (or bitwise)."""
    ids, lp = rlkernel.sample(x, return_logprobs=True, backend="fused", **settings_kw, **noise)
    assert lp.dtype == torch.float32 and lp.shape == ids.shape == x.shape[:-1]
    assert torch.equal(ids, rlkernel.sample(x, backend="fused", **settings_kw, **noise)), "the draw changed"
    worst = assert_raw_logprobs(lp, x, ids, settings_kw.get("temperature", 1.0), bitwise=bitwise)
    print(f"max |sample - logp| = {worst:.3g}")  # the measured gap, for the notes (pytest -s)
    return ids, lp


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [128256, 5003, 40])
@cuda_test
def test_per_row_mixes_within_the_bound(dtype, vocab):
    g = torch.Generator(device="cuda").manual_seed(vocab)
    x = (torch.randn(96, vocab, device="cuda", generator=g) * 3).to(dtype)
    kw = _kw(_mixed_settings(96, vocab, seed=vocab))
    seeds = torch.arange(96, device="cuda") * 7919 + 5
    _, lp = _assert_raw_draw(x, kw, seed=seeds, offset=torch.arange(96, device="cuda"))
    assert bool(torch.isfinite(lp).all()) and bool((lp <= 0).all())


SCALAR_CASES = [  # (settings, the path every row takes: bitwise on the whole-row path)
    (dict(temperature=1.0, top_k=50, top_p=0.9), False),             # the candidates path (the benchmark's)
    (dict(temperature=0.7, top_k=0, top_p=0.9, min_p=0.05), True),   # the whole-row path
    (dict(temperature=1.3, top_k=128, min_p=0.3), False),            # the largest fast k
    (dict(temperature=1.0, top_k=129, top_p=0.95), True),            # just past it: whole row
    (dict(temperature=0.0), False),                                  # argmax: T' = 1
    (dict(temperature=1.0, top_k=1), False),
    (dict(temperature=1.0, top_p=1e-7), True),                       # tiny top_p
    (dict(temperature=0.9, top_k=128256), True),                     # k = V: every token
    (dict(temperature=0.9), True),                                   # no filter
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(SCALAR_CASES)))
@cuda_test
def test_scalar_settings(dtype, case):
    kw, whole_row = SCALAR_CASES[case]
    g = torch.Generator(device="cuda").manual_seed(case)
    x = (torch.randn(33, 128256, device="cuda", generator=g) * 4).to(dtype)
    _assert_raw_draw(x, kw, bitwise=whole_row, seed=123, offset=4)
    gen = torch.Generator(device="cuda")
    ids, lp = rlkernel.sample(x, return_logprobs=True, backend="fused", generator=gen.manual_seed(9), **kw)
    assert torch.equal(ids, rlkernel.sample(x, backend="fused", generator=gen.manual_seed(9), **kw))
    assert_raw_logprobs(lp, x, ids, kw["temperature"], bitwise=whole_row)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [128256, 9000])
@cuda_test
def test_ties_and_boundaries(dtype, vocab):
    base = _tie_rows(vocab, torch.Generator().manual_seed(vocab))
    grid = [(1.0, 50, 1.0, 0.0), (1.0, 50, 0.5, 0.0), (1.0, 0, 0.5, 0.25), (1.0, 128, 0.9, 0.25), (0.0, 0, 1.0, 0.0),
            (1.0, 1, 1.0, 0.0), (0.7, vocab, 0.3, 0.0), (1.0, 0, 1.0, 0.25)]
    x = base.repeat_interleave(len(grid), 0).to(dtype).cuda()
    n = x.shape[0]
    _assert_raw_draw(x, _kw(grid * base.shape[0]), seed=torch.arange(n, device="cuda"), offset=7)


@pytest.mark.parametrize("dtype", DTYPES)
@cuda_test
def test_whole_row_rows_are_bitwise_with_a_scalar_temperature(dtype):
    # a scalar T with per-row filters: the rows whose k is 0 or > 128 (and the overflowing ties) take select's
    # whole-row path, which runs the logp forward's own row reduction: those rows bit for bit
    vocab = 128256
    x = (torch.randn(8, vocab, device="cuda") * 3).to(dtype)
    x[6] = 0.0  # every token tied: every chunk keeps more candidates than it may, the row overflows to the whole row
    x[7, torch.randperm(vocab, device="cuda")[:600]] = 5.0  # ties at the top, still the candidates path
    k = torch.tensor([0, 300, vocab, 129, 50, 50, 50, 50], device="cuda")
    ids, lp = rlkernel.sample(x, temperature=0.8, top_k=k, top_p=0.95, seed=5, return_logprobs=True, backend="fused")
    whole = torch.tensor([True, True, True, True, False, False, True, False], device="cuda")
    assert_raw_logprobs(lp[whole], x[whole], ids[whole], 0.8, bitwise=True)
    assert_raw_logprobs(lp, x, ids, 0.8)


@cuda_test
def test_rows_without_a_distribution_and_infinite_argmax():
    x = torch.randn(6, 20000, device="cuda")
    x[1] = float("-inf")        # no distribution
    x[2, 77] = float("nan")     # no distribution
    x[3, 5] = float("inf")      # T > 0: no distribution
    x[4, 9] = float("inf")      # T = 0 (below): the argmax; its raw log-prob under softmax(x) is NaN (inf - inf)
    settings = [(1.0, 50, 0.9, 0.0), (1.0, 50, 0.9, 0.0), (0.0, 0, 1.0, 0.0), (1.0, 0, 0.9, 0.0),
                (0.0, 0, 1.0, 0.0), (0.8, 0, 1.0, 0.1)]
    kw = _kw(settings)
    ids, lp = rlkernel.sample(x, return_logprobs=True, backend="fused", seed=1, **kw)
    assert ids[1] == -1 and ids[2] == -1 and ids[3] == -1 and ids[4] == 9
    assert bool(torch.isnan(lp[1:5]).all()) and bool(torch.isfinite(lp[torch.tensor([0, 5])]).all())
    with pytest.raises(ValueError, match="row 1"):
        rlkernel.check_errors()
    assert_raw_logprobs(lp, x, ids, kw["temperature"])  # (logp reports the -1 ids too: the fixture clears them)


@cuda_test
def test_only_the_samplers_kernels_run():
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(256, 128256, device="cuda", dtype=torch.bfloat16)
    cases = {"candidates path": dict(temperature=1.0, top_k=50, top_p=0.9),
             "whole-row path": dict(temperature=1.0, top_p=0.9),
             "argmax": dict(temperature=0.0),
             "per-row": _kw(_mixed_settings(256, 128256, seed=1))}
    for name, kw in cases.items():
        rlkernel.sample(x, return_logprobs=True, backend="fused", seed=2, **kw)  # warm
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            rlkernel.sample(x, return_logprobs=True, backend="fused", seed=2, **kw)
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert kernels, name
        assert all("rlkernel_sample_" in k for k in kernels), f"{name}: {kernels}"
        assert not any("logp" in k for k in kernels), f"{name}: a logp kernel ran: {kernels}"
        finals = [k for k in kernels if "rlkernel_sample_select" in k or "rlkernel_sample_rows" in k]
        assert len(finals) == 1, f"{name}: one pass, one final kernel: {kernels}"


@cuda_test
def test_no_host_sync():
    x = torch.randn(48, 128256, device="cuda", dtype=torch.bfloat16) * 3
    kw = _kw(_mixed_settings(48, 128256, seed=6))
    seeds, offsets = torch.arange(48, device="cuda"), torch.arange(48, device="cuda") * 3
    rlkernel.sample(x, seed=seeds, offset=offsets, return_logprobs=True, backend="fused", **kw)  # warm
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ids, lp = rlkernel.sample(x, seed=seeds, offset=offsets, return_logprobs=True, backend="fused", **kw)
        ids2, lp2 = rlkernel.sample(x, top_k=50, top_p=0.9, return_logprobs=True, backend="fused")
        ids3, lp3 = rlkernel.sample(x, temperature=0.0, return_logprobs=True, backend="fused")
        ids4, lp4 = rlkernel.sample(x, top_p=0.9, return_logprobs=True, backend="fused")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert_raw_logprobs(lp, x, ids, kw["temperature"])
    assert_raw_logprobs(lp2, x, ids2, 1.0)
    assert torch.equal(ids3, x.float().argmax(-1))
    assert_raw_logprobs(lp3, x, ids3, 0.0)
    assert_raw_logprobs(lp4, x, ids4, 1.0, bitwise=True)


@cuda_test
def test_cuda_graph_replays_follow_device_seeds_and_offsets():
    x = torch.randn(256, 128256, device="cuda") * 2
    kw = _kw(_mixed_settings(256, 128256, seed=4))
    for g_ids, g_lp, want_lp in sampler_replays_against_eager(x, kw, True):
        assert torch.equal(g_lp.view(torch.int32), want_lp.view(torch.int32)), "replay and eager log-probs differ"
        assert_raw_logprobs(g_lp, x, g_ids, kw["temperature"])


@cuda_test
def test_batch_invariant():
    # a row's raw log-prob is a function of the row alone: the same bits alone, in a batch, at another position
    x = torch.randn(64, 128256, device="cuda", dtype=torch.bfloat16) * 3
    kw = dict(temperature=0.8, top_k=50, top_p=0.9)
    seeds = torch.arange(64, device="cuda") + 3
    _, lp = rlkernel.sample(x, seed=seeds, return_logprobs=True, backend="fused", **kw)
    for r in (0, 17, 63):
        _, one = rlkernel.sample(x[r:r + 1], seed=seeds[r:r + 1], return_logprobs=True, backend="fused", **kw)
        assert torch.equal(one.view(torch.int32), lp[r:r + 1].view(torch.int32)), f"row {r}"
    _, rev = rlkernel.sample(x.flip(0), seed=seeds.flip(0), return_logprobs=True, backend="fused", **kw)
    assert torch.equal(rev.flip(0).view(torch.int32), lp.view(torch.int32))


@pytest.mark.parametrize("argument,value", [("temperature", -1.0), ("temperature", float("nan")), ("top_k", -3),
                                            ("top_p", 0.0), ("top_p", 1.5), ("min_p", 1.5), ("min_p", -0.1)])
@pytest.mark.parametrize("vocab", [128256, 20000])
@cuda_test
def test_bad_per_row_values_reach_the_error_record(argument, value, vocab):
    x = torch.randn(8, vocab, device="cuda")
    kw = _kw([(1.0, 50, 0.9, 0.05)] * 4 + [(0.8, 0, 0.9, 0.0)] * 4)  # both paths around the bad row
    kw[argument][5] = value
    ids, lp = rlkernel.sample(x, seed=1, return_logprobs=True, backend="fused", **kw)
    with pytest.raises(ValueError, match=rf"{argument}.*row 5"):
        rlkernel.check_errors()
    good = torch.arange(8, device="cuda") != 5
    assert ids[5].item() == -1 and bool((ids[good] >= 0).all())
    assert torch.isnan(lp[5]) and bool(torch.isfinite(lp[good]).all())
    t = kw["temperature"][good]
    assert_raw_logprobs(lp[good], x[good], ids[good], t)


@cuda_test
def test_opcheck():
    x = torch.randn(16, 5000, device="cuda")
    t = torch.full((16,), 0.8, device="cuda")
    for args in ((x, 0.8, 50, 0.9, None, 0, 0, 0.05, None, None, None, None, True, 7, None, 3, None, True),
                 (x, 1.0, 0, 1.0, None, 0, 0, 0.0, t, None, None, None, True, 7, None, 3, None, True)):
        torch.library.opcheck(torch.ops.rlkernel.sample_processed.default, args)

