"""The native (reference) backend of rlkernel.sample: the exact filtered law, in plain PyTorch."""
from __future__ import annotations

import torch

from rlkernel.nvtx_ranges import op_range


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """Rows of (probabilities in sorted order, token ids in that order) after top-k and top-p, renormalised.

    Sorted by probability, descending; ties by lower token id (a stable sort keeps id order among equals),
    so "the top k" is always exactly k tokens.
    """
    x = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
    p = torch.softmax(x / temperature, dim=-1)
    sorted_p, order = torch.sort(p, dim=-1, descending=True, stable=True)
    vocab = p.shape[-1]
    if 0 < top_k < vocab:
        sorted_p = sorted_p[..., :top_k]
        order = order[..., :top_k]
    sorted_p = sorted_p / sorted_p.sum(dim=-1, keepdim=True)
    if top_p < 1.0:
        # keep the smallest prefix whose mass reaches top_p: token i stays while the mass before it is < top_p
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        sorted_p = torch.where(before < top_p, sorted_p, torch.zeros_like(sorted_p))
        sorted_p = sorted_p / sorted_p.sum(dim=-1, keepdim=True)
    return sorted_p, order


def _draw(rows, temperature, top_k, top_p, generator):
    if temperature == 0:
        top = rows.amax(dim=-1)
        bad = torch.isnan(top) | (top == float("-inf"))  # a NaN, or no finite logit: no argmax to take
        if bool(bad.any()):
            first = int(bad.nonzero()[0])
            raise ValueError(f"sample: row {first} has no finite probabilities (all -inf or NaN logits)")
        return torch.argmax(rows, dim=-1)  # first maximal index: lowest id among ties
    probs, order = filtered_probs(rows, temperature, top_k, top_p)
    finite = torch.isfinite(probs).all(dim=-1)
    if not bool(finite.all()):
        first = int((~finite).nonzero()[0])
        raise ValueError(f"sample: row {first} has no finite probabilities (all -inf or NaN logits)")
    pick = torch.multinomial(probs, 1, generator=generator)
    return order.gather(-1, pick).squeeze(-1)


def sample_native(logits, *, temperature, top_k, top_p, generator, return_logprobs=False):
    """Draw one id per row: (int64 ids of shape logits.shape[:-1], float32 log-probs or None).

    The log-probs are computed by logp's native code (the same arithmetic as ``rlkernel.logp(backend="native")``)
    inside this op's ``op.sample`` range: they are part of the sampler's work, not a separate logp call, so a
    trace or a dispatch history shows no logp op for them."""
    from rlkernel.ops.logp_native import native_logp_values

    vocab = logits.shape[-1]
    rows = logits.reshape(-1, vocab)
    with op_range("op.sample"):
        if rows.shape[0] == 0:
            ids = torch.empty(rows.shape[0], dtype=torch.long, device=logits.device)
        else:
            ids = _draw(rows, temperature, top_k, top_p, generator)
        lp = None
        if return_logprobs:
            lp = native_logp_values(rows, ids, temperature if temperature > 0 else 1.0).reshape(logits.shape[:-1])
    return ids.reshape(logits.shape[:-1]), lp
