"""The softmax pieces the native backends share (one copy each): the compute dtype, a row's log-sum-exp /
log-probs / probabilities, and the entropy of a row distribution.

Two entropy formulas stay where they are on purpose, because they give other bits: the processed log-probs' one
(native/logp_processed.py) sums in ``filters.row_sum``'s fixed order for batch invariance, and the chunked loss's
native pass (ops/linear_logp_loss_chunks.py) is written for autograd to differentiate.
"""
from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the native arithmetic runs in: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def row_stats(x: torch.Tensor):
    """Log-sum-exp, log-probs and probabilities of each row of x (already divided by T)."""
    lse = torch.logsumexp(x, dim=-1)
    logp_all = x - lse.unsqueeze(-1)
    p = logp_all.exp()
    return lse, logp_all, p


def entropy(p: torch.Tensor, logp_all: torch.Tensor) -> torch.Tensor:
    """-sum p log p over the last dim. p log p is 0 where p is 0 (a -inf logit); NaN stays NaN (an all -inf or NaN
    row)."""
    plogp = torch.where(p > 0, p * logp_all, torch.where(torch.isnan(p), p, torch.zeros_like(p)))
    return -plogp.sum(dim=-1)
