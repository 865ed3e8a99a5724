"""The native sampler draws from the exact filtered law (chi-square) and is reproducible (CPU)."""

import pytest
import torch
from reference import chi_square_pvalue, filtered_distribution

import rlkernel

DRAWS = 20000


@pytest.mark.parametrize("top_k,top_p,temperature", [(0, 1.0, 1.0), (5, 1.0, 0.6), (50, 0.9, 1.0), (1, 0.5, 1.0),
                                                     (0, 0.1, 1.0), (0, 0.9, 0.6), (30, 0.8, 1.3)])
def test_law_matches_exact_filtered_distribution(top_k, top_p, temperature):
    vocab = 97
    g = torch.Generator().manual_seed(top_k * 31 + int(top_p * 10))
    row = torch.randn(vocab, generator=g) * 2
    row[3] = row[10] = row[20]  # ties
    row[40:45] = float("-inf")
    logits = row.expand(DRAWS, vocab)
    ids = rlkernel.sample(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                          generator=torch.Generator().manual_seed(1), backend="native")
    probs = filtered_distribution(row, temperature, top_k, top_p)
    counts = torch.bincount(ids, minlength=vocab).double()
    assert torch.all(counts[probs == 0] == 0), "drew a token outside the kept set"
    # p-value threshold 1e-4: a correct sampler fails this once in 10,000 runs, and the seeds are fixed
    assert chi_square_pvalue(counts, probs) > 1e-4


def test_ties_keep_lower_ids_first():
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.5]])
    probs = filtered_distribution(logits[0], 1.0, 2, 1.0)
    assert probs.nonzero().flatten().tolist() == [1, 2]
    ids = rlkernel.sample(logits.expand(2000, 5), top_k=2, generator=torch.Generator().manual_seed(0),
                          backend="native")
    assert set(ids.tolist()) == {1, 2}


def test_temperature_zero_is_argmax_lowest_id():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 1.0, 5.0, 5.0]])
    ids, lp = rlkernel.sample(logits, temperature=0, return_logprobs=True, backend="native")
    assert ids.tolist() == [1, 0]
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).gather(-1, ids[:, None]).squeeze(-1))


def test_reproducible_with_seeded_generator_and_logprobs_equal_logp():
    logits = torch.randn(4, 3, 1000, generator=torch.Generator().manual_seed(3))
    a, lpa = rlkernel.sample(logits, top_k=50, top_p=0.9, temperature=0.8,
                             generator=torch.Generator().manual_seed(9), return_logprobs=True, backend="native")
    b = rlkernel.sample(logits, top_k=50, top_p=0.9, temperature=0.8, generator=torch.Generator().manual_seed(9),
                        backend="native")
    assert a.shape == (4, 3) and a.dtype == torch.long
    assert torch.equal(a, b)
    assert torch.equal(lpa, rlkernel.logp(logits, a, temperature=0.8, backend="native"))  # bitwise: same path


def test_bad_input_errors():
    logits = torch.randn(2, 5)
    with pytest.raises(ValueError, match="top_p"):
        rlkernel.sample(logits, top_p=0)
    with pytest.raises(ValueError, match="top_p"):
        rlkernel.sample(logits, top_p=1.5)
    with pytest.raises(ValueError, match="top_k"):
        rlkernel.sample(logits, top_k=-1)
    for bad_t in (-1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            rlkernel.sample(logits, temperature=bad_t)
    with pytest.raises(TypeError):
        rlkernel.sample(torch.ones(2, 5, dtype=torch.int32))
    bad = logits.clone()
    bad[1] = float("-inf")
    with pytest.raises(ValueError, match="row 1"):
        rlkernel.sample(bad)
    assert rlkernel.sample(torch.randn(0, 5)).shape == (0,)
    with pytest.raises(ValueError, match="vocabulary of size 0"):
        rlkernel.sample(torch.randn(3, 0))
    nan_row = logits.clone()
    nan_row[1, 2] = float("nan")
    for t in (0, 1.0):  # greedy or not, a NaN row has no distribution (never a silent id)
        with pytest.raises(ValueError, match="row 1"):
            rlkernel.sample(nan_row, temperature=t)
        with pytest.raises(ValueError, match="row 1"):
            rlkernel.sample(bad, temperature=t)
