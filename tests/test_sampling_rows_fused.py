"""The fused sampler with per-row settings and seeds, and the fused processed log-probs (CUDA): the law per row in
batches that mix settings, bitwise batch invariance of seeded rows (ids and processed log-probs), processed
log-probs and their gradient against float64, sampler == logp (processed: bit for bit; raw: within the contract's
bound), CUDA-graph replays with a device offset,
bad per-row values through the device error record, and no host sync."""
import contextlib

import pytest
import torch
from raw_logprobs import assert_raw_logprobs
from reference import chi_square_pvalue
from reference_filtered import kept_set, processed_grad_ref, processed_ref

import rlkernel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(autouse=True)
def _need_fused_and_a_clean_record():
    from rlkernel import _ext

    # not a skip: on a CUDA machine these tests need the build (python setup.py build_ext --inplace)
    assert _ext.unavailable_reason() is None and _ext.has_op("logp_processed_forward"), _ext.unavailable_reason()
    rlkernel.check_errors()
    yield
    with contextlib.suppress(IndexError, ValueError):
        rlkernel.check_errors()


def _settings_tensors(settings, device="cuda"):
    t, k, p, m = zip(*settings, strict=True)
    return (torch.tensor(t, dtype=torch.float32, device=device), torch.tensor(k, dtype=torch.int64, device=device),
            torch.tensor(p, dtype=torch.float32, device=device), torch.tensor(m, dtype=torch.float32, device=device))


def _kw(settings):
    t, k, p, m = _settings_tensors(settings)
    return dict(temperature=t, top_k=k, top_p=p, min_p=m)


# (T, k, p, min_p): every value of the grid appears; V = 1000
MIXED = [(1.0, 50, 0.9, 0.0), (0.7, 0, 0.9, 0.05), (1.0, 1000, 0.3, 0.0), (0.7, 50, 1.0, 0.3), (0.0, 0, 1.0, 0.0),
         (1.0, 1, 1.0, 0.0), (1.0, 0, 1.0, 0.05), (0.7, 200, 0.9, 0.05)]


@pytest.mark.parametrize("mode", ["seeded", "generator"])
def test_law_per_row_in_a_batch_that_mixes_settings(mode):
    vocab, draws = 1000, 20000
    g = torch.Generator().manual_seed(1)
    base = []
    for s in MIXED:  # rows whose top-p / min-p decisions are not within 1e-5 of their thresholds (float32 vs float64)
        row = torch.randn(vocab, generator=g) * 2
        while kept_set(row, *s)[2] <= 1e-5:
            row = torch.randn(vocab, generator=g) * 2
        base.append(row)
    logits = torch.cat([r.expand(draws, vocab) for r in base]).cuda()
    rows = [s for s in MIXED for _ in range(draws)]
    extra = dict(seed=torch.arange(len(rows), device="cuda") * 7919 + 3, offset=11) if mode == "seeded" else dict(
        generator=torch.Generator(device="cuda").manual_seed(5))
    ids = rlkernel.sample(logits, backend="fused", **_kw(rows), **extra).cpu()
    for j, s in enumerate(MIXED):
        kept, q, _ = kept_set(base[j], *s)
        counts = torch.bincount(ids[j * draws:(j + 1) * draws], minlength=vocab).double()
        assert counts.sum() == draws
        assert torch.all(counts[q == 0] == 0), f"settings {s}: drew outside the kept set"
        if len(kept) > 1:
            assert chi_square_pvalue(counts, q) > 1e-5, f"settings {s}"


def _random_settings(n, vocab, g):
    out = []
    for _ in range(n):
        pick = lambda seq: seq[int(torch.randint(len(seq), (), generator=g))]  # noqa: E731
        out.append((pick([0.0, 0.7, 1.0, 1.3]), pick([0, 1, 20, 50, 128, 300, vocab]), pick([0.3, 0.9, 1.0]),
                    pick([0.0, 0.05, 0.3])))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [128256, 5003])
def test_seeded_rows_are_bitwise_batch_invariant(dtype, vocab):
    # a row drawn alone vs the same row at several positions among 255 random others (mixed settings, k = 0 rows
    # included), in batches of several sizes: the same id and the same processed log-prob, bit for bit
    g = torch.Generator().manual_seed(vocab)
    others = (torch.randn(256, vocab, generator=g) * 3).to(dtype).cuda()
    other_settings = _random_settings(256, vocab, g)
    seeds = torch.randint(0, 2**62, (256,), generator=g).cuda()
    offsets = torch.randint(0, 10**6, (256,), generator=g).cuda()
    probes = [(1.0, 50, 0.9, 0.0), (0.7, 0, 0.9, 0.05), (1.0, 0, 1.0, 0.0), (1.0, 300, 0.9, 0.0), (0.0, 0, 1.0, 0.0),
              (1.3, 128, 1.0, 0.3)]
    for j, setting in enumerate(probes):
        row = (torch.randn(1, vocab, generator=g) * 3).to(dtype).cuda()
        seed, off = seeds[j:j + 1], offsets[j:j + 1]
        alone, lp_alone = rlkernel.sample(row, seed=seed, offset=off, return_logprobs="processed", backend="fused",
                                          **_kw([setting]))
        for pos, n in [(0, 256), (17, 256), (255, 256), (3, 40)]:
            x, st = others[:n].clone(), list(other_settings[:n])
            x[pos] = row[0]
            st[pos] = setting
            s, o = seeds[:n].clone(), offsets[:n].clone()
            s[pos], o[pos] = seed[0], off[0]
            ids, lp = rlkernel.sample(x, seed=s, offset=o, return_logprobs="processed", backend="fused", **_kw(st))
            assert ids[pos] == alone[0], f"setting {setting}: id differs at position {pos} of {n}"
            assert torch.equal(lp[pos:pos + 1].view(torch.int32), lp_alone.view(torch.int32)), \
                f"setting {setting}: processed log-prob bits differ at position {pos} of {n}"
    # a seed draws afresh: two offsets of the same 256 rows give different ids
    kw = _kw(other_settings)
    a = rlkernel.sample(others, seed=seeds, offset=offsets, backend="fused", **kw)
    b = rlkernel.sample(others, seed=seeds, offset=offsets + 1, backend="fused", **kw)
    assert not torch.equal(a, b)
    assert torch.equal(a, rlkernel.sample(others, seed=seeds, offset=offsets, backend="fused", **kw))


PROCESSED_CASES = [(torch.float32, 5e-5, 1e-5), (torch.bfloat16, 5e-5, 1e-5), (torch.float16, 5e-5, 1e-5)]


def _processed_inputs(dtype, n=24, vocab=3001, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, vocab, generator=g) * 2.5).to(dtype)
    settings = _random_settings(n, vocab, g)
    return x, settings, g


@pytest.mark.parametrize("dtype,atol,rtol", PROCESSED_CASES)
def test_processed_logp_matches_float64_including_ids_outside_the_kept_set(dtype, atol, rtol):
    x, settings, g = _processed_inputs(dtype)
    n, vocab = x.shape
    xc = x.cuda()
    drawn = rlkernel.sample(xc, seed=torch.arange(n, device="cuda"), backend="fused", **_kw(settings))
    outside = torch.randint(0, vocab, (n,), generator=g)  # mostly outside the kept set
    for ids in (drawn.cpu(), outside):
        lp, ent = rlkernel.logp(xc, ids.cuda(), return_entropy=True, backend="fused", **_kw(settings))
        ref_lp, ref_ent, margins = processed_ref(x.float(), ids, settings)
        ok = torch.tensor([m > 1e-4 for m in margins])  # rows with a decision within 1e-4 of its threshold: either
        assert ok.sum() >= n // 2                        # side is right in float32; the rest must be exact
        lp, ent = lp.cpu().double(), ent.cpu().double()
        assert torch.equal(torch.isinf(lp)[ok], torch.isinf(ref_lp)[ok]), "kept set differs from float64"
        fin = ok & torch.isfinite(ref_lp)
        torch.testing.assert_close(lp[fin], ref_lp[fin], atol=atol, rtol=rtol)
        torch.testing.assert_close(ent[ok], ref_ent[ok], atol=atol * 4, rtol=rtol)


@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float32, 1e-5, 1e-4), (torch.bfloat16, 2e-3, 1e-2)])
def test_processed_backward_matches_float64(dtype, atol, rtol):
    x, settings, g = _processed_inputs(dtype, n=16, vocab=2003, seed=3)
    n, vocab = x.shape
    ids = torch.where(torch.rand(n, generator=g) < 0.5, x.float().argmax(-1),
                      torch.randint(0, vocab, (n,), generator=g))
    ids[5] = -100  # ignore_index: no gradient
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    xc = x.cuda().requires_grad_(True)
    lp, ent = rlkernel.logp(xc, ids.cuda(), return_entropy=True, backend="fused", **_kw(settings))
    # the row gradients reach every row, those whose id is outside the kept set (log-prob -inf) included
    (grad,) = torch.autograd.grad((lp, ent), xc, grad_outputs=(g_lp.cuda(), g_ent.cuda()))
    _, _, margins = processed_ref(x.float(), ids.clamp(min=0), settings)
    ok = torch.tensor([m > 1e-4 for m in margins])
    ref = processed_grad_ref(x.float(), ids, settings, g_lp, g_ent)
    ref[5] = 0.0
    torch.testing.assert_close(grad.cpu().double()[ok], ref[ok], atol=atol, rtol=rtol)


def test_sampler_processed_and_raw_logprobs_equal_logp_bitwise():
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(64, 32000, device="cuda", generator=g, dtype=torch.bfloat16) * 3
    settings = _random_settings(64, 32000, torch.Generator().manual_seed(2))
    kw = _kw(settings)
    ids, lp = rlkernel.sample(x, seed=7, offset=torch.arange(64, device="cuda"), return_logprobs="processed",
                              backend="fused", **kw)
    assert torch.equal(lp.view(torch.int32), rlkernel.logp(x, ids, backend="fused", **kw).view(torch.int32))
    ids, raw = rlkernel.sample(x, seed=7, return_logprobs=True, backend="fused", **kw)
    # the raw log-probs come from the sampler's own pass too: within the contract's bound of rlkernel.logp (per-row
    # T: logp's processed kernel scales by 1/T, the sampler by log2(e)/T; docs/contracts.md, section 1)
    assert_raw_logprobs(raw, x, ids, kw["temperature"])


def test_cuda_graph_replays_follow_a_device_offset():
    x = torch.randn(256, 32000, device="cuda") * 2
    settings = _random_settings(256, 32000, torch.Generator().manual_seed(4))
    kw = _kw(settings)
    seeds = torch.arange(256, device="cuda") + 1000
    offset = torch.zeros(256, dtype=torch.int64, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up outside the capture
        rlkernel.sample(x, seed=seeds, offset=offset, backend="fused", **kw)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, lp = rlkernel.sample(x, seed=seeds, offset=offset, return_logprobs="processed", backend="fused", **kw)
    got = []
    for step in range(3):
        offset.fill_(step)
        graph.replay()
        got.append((ids.clone(), lp.clone()))
    for step in range(3):
        want, want_lp = rlkernel.sample(x, seed=seeds, offset=torch.full_like(offset, step),
                                        return_logprobs="processed", backend="fused", **kw)
        assert torch.equal(got[step][0], want), f"replay {step} differs from the eager call at that offset"
        assert torch.equal(got[step][1].view(torch.int32), want_lp.view(torch.int32))
    assert not torch.equal(got[0][0], got[1][0]), "the offset did not reach the kernel"


@pytest.mark.parametrize("argument,value", [("temperature", -1.0), ("temperature", float("nan")), ("top_k", -3),
                                            ("top_p", 0.0), ("top_p", 1.5), ("min_p", 1.5), ("min_p", -0.1)])
def test_bad_per_row_values_reach_the_error_record(argument, value):
    x = torch.randn(8, 20000, device="cuda")
    settings = [(1.0, 50, 0.9, 0.05)] * 8
    kw = _kw(settings)
    kw[argument][5] = value
    ids = rlkernel.sample(x, seed=1, backend="fused", **kw)
    with pytest.raises(ValueError, match=rf"{argument}.*row 5"):
        rlkernel.check_errors()
    assert ids[5].item() == -1 and bool((ids[torch.arange(8, device="cuda") != 5] >= 0).all())
    lp = rlkernel.logp(x, torch.zeros(8, dtype=torch.int64, device="cuda"), backend="fused", **kw)
    assert torch.isnan(lp[5])
    with pytest.raises(ValueError, match=rf"{argument}.*row 5"):
        rlkernel.check_errors()


def test_per_row_calls_do_not_sync_the_host():
    x = torch.randn(48, 32003, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kw = _kw(_random_settings(48, 32003, torch.Generator().manual_seed(6)))
    seeds, offsets = torch.arange(48, device="cuda"), torch.arange(48, device="cuda") * 3
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ids, lp = rlkernel.sample(x.detach(), seed=seeds, offset=offsets, return_logprobs="processed",
                                  backend="fused", **kw)
        ids2 = rlkernel.sample(x.detach(), seed=5, offset=9, min_p=0.1, top_k=50, backend="fused")
        out, ent = rlkernel.logp(x, ids, return_entropy=True, backend="fused", **kw)
        (out.nan_to_num(0.0, 0.0, 0.0).sum() + ent.sum()).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert x.grad is not None and bool((ids2 >= 0).all())
    assert torch.equal(lp.view(torch.int32), out.detach().view(torch.int32))


def test_processed_forward_compiles_without_graph_break():
    from rlkernel.ops.fused.logp_processed import logp_processed_fused

    x = torch.randn(8, 4000, device="cuda")
    ids = torch.randint(0, 4000, (8,), device="cuda")
    kw = _kw([(1.0, 50, 0.9, 0.05)] * 8)

    def f(x):
        lp, _ = logp_processed_fused(x * 2.0, ids, ignore_index=-100, return_entropy=False, **kw)
        return lp

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True)(x)
    assert torch.equal(got.view(torch.int32), f(x).view(torch.int32))
