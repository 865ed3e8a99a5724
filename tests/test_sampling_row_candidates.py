"""The whole-row path's candidate list (CUDA; csrc/include/rlkernel/sampling_row_candidates.cuh): rows with
kMaxFastK < top_k <= 1024 (and top-k rows that overflow the fast path) run the exact law on the tokens at or above
a bound read from each thread's four largest, instead of on the whole row. The law is the same: the kept set
(float64, ties to the lowest ids), the processed log-probs and entropy, the sampler's draws, and, where more tokens
tie at the bound than the list holds, the whole-row fallback."""
import contextlib

import pytest
import torch
from reference import chi_square_pvalue
from reference_filtered import kept_set, processed_ref

import rlkernel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# (T, k, p, min_p): k above the fast path's 128, up to the list's 1024, with top_p and min_p after it
LARGE_K = [(1.0, 129, 1.0, 0.0), (0.8, 300, 0.9, 0.0), (1.0, 1024, 0.95, 0.0), (1.3, 700, 1.0, 0.05),
           (1.0, 1024, 1.0, 0.0), (0.6, 500, 0.5, 0.1)]


@pytest.fixture(autouse=True)
def _need_fused_and_a_clean_record():
    from rlkernel import _ext

    # not a skip: on a CUDA machine these tests need the build (python setup.py build_ext --inplace)
    assert _ext.unavailable_reason() is None, _ext.unavailable_reason()
    rlkernel.check_errors()
    yield
    with contextlib.suppress(IndexError, ValueError):
        rlkernel.check_errors()


def _check_processed(x, settings, kw, g):
    """rlkernel.logp's processed log-probs and entropy of x (CUDA) against float64, for the sampler's own draws
    and for ids mostly outside the kept set; and the sampler's processed log-probs equal logp's bit for bit."""
    n, vocab = x.shape
    drawn, sampled_lp = rlkernel.sample(x, seed=torch.arange(n, device="cuda"), return_logprobs="processed",
                                        backend="fused", **kw)
    assert torch.equal(sampled_lp.view(torch.int32),
                       rlkernel.logp(x, drawn, backend="fused", **kw).view(torch.int32))
    outside = torch.randint(0, vocab, (n,), generator=g)
    for ids in (drawn.cpu(), outside):
        lp, ent = rlkernel.logp(x, ids.cuda(), return_entropy=True, backend="fused", **kw)
        ref_lp, ref_ent, margins = processed_ref(x.cpu().float(), ids, settings)
        ok = torch.tensor([m > 1e-4 for m in margins])  # a decision within 1e-4 of its threshold: either side
        assert ok.sum() >= n // 2
        lp, ent = lp.cpu().double(), ent.cpu().double()
        assert torch.equal(torch.isinf(lp)[ok], torch.isinf(ref_lp)[ok]), "kept set differs from float64"
        fin = ok & torch.isfinite(ref_lp)
        torch.testing.assert_close(lp[fin], ref_lp[fin], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(ent[ok], ref_ent[ok], atol=1e-4, rtol=1e-4)
    # the draws lie in their rows' kept sets (rows whose decisions are clear of the thresholds)
    for r in range(n):
        kept, _, margin = kept_set(x[r].cpu().float(), *settings[r])
        if margin > 1e-4:
            assert int(drawn[r]) in set(kept), f"row {r} {settings[r]}: drew {int(drawn[r])} outside the kept set"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [32000, 128256])
def test_large_top_k_rows_per_row_settings_match_float64(dtype, vocab):
    # per-row settings: the candidates kernel runs, and select hands these rows (k > 128) to row_law
    g = torch.Generator().manual_seed(vocab)
    settings = LARGE_K + [(1.0, 50, 0.9, 0.0)]  # one fast-path row beside them
    x = (torch.randn(len(settings), vocab, generator=g) * 2.5).to(dtype).cuda()
    t, k, p, m = (torch.tensor(c, device="cuda") for c in zip(*settings, strict=True))
    kw = dict(temperature=t.float(), top_k=k.long(), top_p=p.float(), min_p=m.float())
    _check_processed(x, settings, kw, g)


@pytest.mark.parametrize("setting", LARGE_K, ids=lambda s: f"T{s[0]}-k{s[1]}-p{s[2]}-minp{s[3]}")
def test_large_top_k_scalar_settings_match_float64(setting):
    # scalar settings with k > 128: every row goes to rlkernel_sample_rows, which runs row_law
    vocab, n = 128256, 4
    g = torch.Generator().manual_seed(setting[1])
    x = (torch.randn(n, vocab, generator=g) * 2.5).to(torch.bfloat16).cuda()
    t, k, p, m = setting
    _check_processed(x, [setting] * n, dict(temperature=t, top_k=k, top_p=p, min_p=m), g)


def test_large_top_k_draws_follow_the_law():
    vocab, draws, k = 128256, 40000, 300
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(5)) * 0.5
    ids = rlkernel.sample(row.cuda().expand(draws, vocab), top_k=k, generator=torch.Generator(
        device="cuda").manual_seed(3), backend="fused")
    kept, q, _ = kept_set(row, 1.0, k, 1.0, 0.0)
    assert len(kept) == k
    counts = torch.bincount(ids.cpu(), minlength=vocab).double()
    assert torch.all(counts[q == 0] == 0), f"drew outside the top {k}: {counts[q == 0].nonzero()[:5].flatten()}"
    assert chi_square_pvalue(counts, q) > 1e-5


@pytest.mark.parametrize("n_tied", [1500, 3000])
def test_ties_at_the_kth_key_keep_the_lowest_ids_on_the_list_and_past_its_cap(n_tied):
    # 100 distinct top logits, then n_tied tokens sharing the next value: the top 1024 ends inside the tie.
    # 1500 tied: about 1600 candidates, on the list; 3000: more than its 2048, so the row runs on the whole row.
    vocab, k = 128256, 1024
    g = torch.Generator().manual_seed(n_tied)
    x = torch.randn(2, vocab, generator=g) * 0.5
    for r in range(2):
        where = torch.randperm(vocab, generator=g)[: 100 + n_tied]
        x[r, where[:100]] = 5.1 + 0.9 * torch.rand(100, generator=g)
        x[r, where[100:]] = 5.0
    settings = [(1.0, k, 1.0, 0.0)] * 2
    xc = x.cuda()
    every = torch.arange(vocab)
    for r in range(2):
        kept, _, _ = kept_set(x[r], *settings[r])
        assert len(kept) == k
        # every token's processed log-prob (the row repeated by a stride-0 view, 8192 ids a call): finite exactly
        # on the kept set
        finite = torch.zeros(vocab, dtype=torch.bool)
        for start in range(0, vocab, 8192):
            ids = every[start:start + 8192]
            lp = rlkernel.logp(xc[r].expand(ids.numel(), vocab), ids.cuda(), top_k=k, backend="fused")
            finite[start:start + ids.numel()] = torch.isfinite(lp).cpu()
        assert finite.nonzero().flatten().tolist() == kept


def test_masked_rows_with_fewer_finite_logits_than_k_match_float64():
    # a grammar-style mask: 500 allowed tokens and top_k 1024, so the bound falls to -inf's key and the row takes
    # the whole-row law at once; beside it a row with 3000 allowed tokens, on the list
    vocab, g = 128256, torch.Generator().manual_seed(7)
    x = torch.full((2, vocab), float("-inf"))
    for r, allowed in enumerate((500, 3000)):
        where = torch.randperm(vocab, generator=g)[:allowed]
        x[r, where] = torch.randn(allowed, generator=g) * 2
    settings = [(1.0, 1024, 0.9, 0.0)] * 2
    _check_processed(x.cuda(), settings, dict(temperature=1.0, top_k=1024, top_p=0.9), g)


def _clear_top_p_alone(row, temperature, mass, min_p=False):
    """(T, 0, top_p, min_p) for a row (float32 on the CPU, already its dtype's values): top_p halfway through the
    step of the token at which the sorted mass first reaches `mass`, and (min_p=True) min_p halfway between the two
    lowest p / p_max levels of the tokens top_p keeps: each decision as far from its threshold as the row allows, so
    float32 rounding cannot move it and the float64 kept set can be checked."""
    p = torch.softmax(row.double() / temperature, -1).sort(descending=True).values
    after = p.cumsum(0)
    j = int(torch.searchsorted(after, torch.tensor([mass], dtype=torch.float64)))
    assert j < len(p), f"mass {mass} is not reached"
    top_p = float(after[j] - p[j] / 2)
    levels = (p[:j + 1] / p[0]).unique()  # ascending
    assert len(levels) >= 2 or not min_p, "top_p keeps a single p / p_max level: no min_p cut between two"
    return temperature, 0, top_p, float((levels[0] + levels[1]) / 2) if min_p else 0.0


def _top_p_alone_row(ties, g, vocab=128256):
    """A row whose top_p crossing has a clear margin: a head that holds most of the mass over a Gaussian tail. With
    ties, 20 tokens above `ties` tokens tied at 8.0, where the settings below put the crossing."""
    row = torch.randn(vocab, generator=g)
    where = torch.randperm(vocab, generator=g)
    if ties:
        row[where[:20]] = 10.0 + torch.rand(20, generator=g)
        row[where[20:20 + ties]] = 8.0
    else:
        row[where[:400]] = 7.0 + 3 * torch.rand(400, generator=g)
    return row.to(torch.bfloat16).float()


@pytest.mark.parametrize("ties", [0, 3000])
def test_top_p_alone_rows_match_float64(ties):
    # top_p alone (no top_k: the whole-row law, which builds no candidate list for it), with and without 3000
    # tokens tied at the value where the mass crosses (the ids order the tie; a path that lists the crossing value's
    # tokens would overflow the list's kRowCandCap of 2048). The three rows are permutations of one row, so one
    # setting fits all of them (the scalar calls) and its ties sit at other ids in each.
    vocab, g = 128256, torch.Generator().manual_seed(11 + ties)
    base = _top_p_alone_row(ties, g, vocab)
    x = torch.stack([base[torch.randperm(vocab, generator=g)] for _ in range(3)])
    settings = [_clear_top_p_alone(base, 1.0, 0.8), _clear_top_p_alone(base, 0.7, 0.5, min_p=True),
                _clear_top_p_alone(base, 1.3, 0.5)]
    for s in settings:  # the inputs are what the comments say (CPU-side preconditions, not the kernel's check)
        kept, _, margin = kept_set(base, *s)
        assert margin > 1e-4, (s, margin)
        if ties and s[3] == 0:
            assert 0 < int((base[kept] == 8.0).sum()) < ties, "the top_p crossing is not inside the tied block"
    t, k, p, m = (torch.tensor(c, device="cuda") for c in zip(*settings, strict=True))
    _check_processed(x.to(torch.bfloat16).cuda(), settings,
                     dict(temperature=t.float(), top_k=k.long(), top_p=p.float(), min_p=m.float()), g)
    for s in settings:  # scalar settings: rlkernel_sample_rows
        _check_processed(x.to(torch.bfloat16).cuda(), [s] * 3, dict(temperature=s[0], top_p=s[2], min_p=s[3]), g)
