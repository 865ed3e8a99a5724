"""Hints in the ops' and the analyzer's error messages for a new user's usual slips (issue 40)."""
from __future__ import annotations

import pytest
import torch

import rlkernel
from pipelines import analyze

RANKS = __import__("pathlib").Path(__file__).resolve().parent / "data" / "ranks"


def test_an_lm_head_module_as_weight_says_pass_its_weight():
    hidden, ids = torch.randn(2, 3, 8), torch.randint(0, 16, (2, 3))
    with pytest.raises(TypeError, match=r"got the module Linear: pass its parameter \(lm_head\.weight, and "
                                        r"bias=lm_head\.bias\)"):
        rlkernel.linear_logp(hidden, torch.nn.Linear(8, 16), ids)
    with pytest.raises(TypeError, match=r"pass its parameter \(lm_head\.weight\)$"):
        rlkernel.linear_logp_loss(hidden, torch.nn.Linear(8, 16, bias=False), ids, lambda lp, en, sl: -lp)


def test_top_k_minus_one_says_zero_means_all():
    with pytest.raises(ValueError, match=r"got -1 \(0 = all tokens: pass 0 for vLLM's -1\)"):
        rlkernel.sample(torch.randn(2, 16), top_k=-1)
    with pytest.raises(ValueError, match=r"top_k of row 1 is out of range \(-1\): must be an integer >= 0 \(0 = all"):
        rlkernel.sample(torch.randn(2, 16), top_k=torch.tensor([1, -1]))


@pytest.mark.parametrize("shape", [(2,), (2, 1)])
def test_a_per_sequence_temperature_says_how_to_expand_it(shape):
    logits, ids = torch.randn(2, 3, 16), torch.randint(0, 16, (2, 3))
    with pytest.raises(ValueError, match=r"for one value per sequence, expand it over the positions: "
                                         r"temperature\.reshape\(2, 1\)\.expand\(2, 3\)"):
        rlkernel.logp(logits, ids, temperature=torch.ones(shape))
    t = torch.tensor([0.5, 2.0])  # the hint's expression is the per-row form the op takes
    lp = rlkernel.logp(logits, ids, temperature=t.reshape(2, 1).expand(2, 3), backend="native")
    assert torch.allclose(lp[1], rlkernel.logp(logits[1], ids[1], temperature=2.0, backend="native"))


def test_a_loss_fn_of_the_wrong_arity_names_the_signature():
    hidden, weight, ids = torch.randn(4, 8), torch.randn(16, 8), torch.randint(0, 16, (4,))
    with pytest.raises(TypeError, match=r"loss_fn is called as loss_fn\(logp, entropy, chunk_slice\).*signature is "
                                        r"\(lp, ent\)"):
        rlkernel.linear_logp_loss(hidden, weight, ids, lambda lp, ent: -lp)
    loss = rlkernel.linear_logp_loss(hidden, weight, ids, lambda *args: -args[0], backend="native")  # *args binds
    assert loss.dim() == 0


def test_analyze_on_a_folder_of_rank_exports_says_use_ranks(capsys):
    assert analyze.main([str(RANKS)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"pipelines.analyze: {RANKS}: no trace.sqlite, but 3 exports in it: for the ranks of one job use "
                   f"--ranks {RANKS}; for one of them pass its file"]
