"""The native (reference) backend of rlkernel.sample: the exact filtered law, in plain PyTorch."""
from __future__ import annotations

import torch

from rlkernel import errors
from rlkernel.nvtx_ranges import op_range
from rlkernel.validate import no_distribution_error


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
    """(ids, bad rows). The draw is an exponential race, argmax of p_i / E_i with E_i ~ Exp(1), which picks i with
    probability p_i exactly and needs no host sync (torch.multinomial reads back to the host on CUDA). A row without
    a distribution gets -1: on CPU it raises here; on CUDA the caller reports it to the device error record."""
    if temperature == 0:
        top = rows.amax(dim=-1)
        bad = torch.isnan(top) | (top == float("-inf"))  # a NaN, or no finite logit: no argmax to take
        ids = torch.argmax(rows, dim=-1)  # first maximal index: lowest id among ties
    else:
        probs, order = filtered_probs(rows, temperature, top_k, top_p)
        bad = ~torch.isfinite(probs).all(dim=-1)
        race = torch.empty_like(probs).exponential_(generator=generator)
        # a token outside the kept set (p = 0) never wins: -1 is below every p / E >= 0
        score = torch.where(probs > 0, probs / race, torch.full_like(probs, -1.0))
        ids = order.gather(-1, score.argmax(dim=-1, keepdim=True)).squeeze(-1)
    if rows.device.type == "cpu" and not torch.compiler.is_compiling() and bool(bad.any()):  # compiled: -1 only
        raise no_distribution_error(int(bad.nonzero()[0]))
    return torch.where(bad, torch.full_like(ids, -1), ids), bad


def sample_native(logits, *, temperature, top_k, top_p, generator, return_logprobs=False):
    """Draw one id per row: (int64 ids of shape logits.shape[:-1], float32 log-probs or None).

    The log-probs are computed by logp's native code (the same arithmetic as ``rlkernel.logp(backend="native")``)
    inside this op's ``op.sample`` range: they are part of the sampler's work, not a separate logp call, so a
    trace or a dispatch history shows no logp op for them."""
    from rlkernel.ops.logp_native import native_logp_values

    lead, vocab = logits.shape[:-1], logits.shape[-1]
    rows = logits.reshape(lead.numel(), vocab)
    with op_range("op.sample"):
        if rows.shape[0] == 0:
            ids = torch.empty(0, dtype=torch.long, device=logits.device)
        else:
            ids, bad = _draw(rows, temperature, top_k, top_p, generator)
            if rows.device.type == "cuda":
                address, seq, sync = errors.begin("sample", logits.device, lead, vocab)
                errors.note_native(errors.ERR_SAMPLE_NO_DIST, seq, address, logits.device, bad, None)
                errors.after_call(logits.device, sync)
        lp = None
        if return_logprobs:
            lp = native_logp_values(rows, ids, temperature if temperature > 0 else 1.0).reshape(lead)
    return ids.reshape(lead), lp
