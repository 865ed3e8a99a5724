"""The native (reference) backend of rlkernel.logp, in plain PyTorch.

Forward and backward are written out (the backward is the same formula the fused kernel uses), so
the native path also opens its ``op.logp.backward`` range and records its ``logp.backward`` dispatch.
Arithmetic is float32 for 16/32-bit logits and float64 for float64 logits.
"""
from __future__ import annotations

import torch

from rlkernel import dispatch, errors
from rlkernel.nvtx_ranges import op_range
from rlkernel.ops import second_order
from rlkernel.ops.native.softmax import compute_dtype, entropy, row_stats


class _NativeLogp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, safe_ids, valid, bad, temperature, return_entropy, requested, status, reason):
        x = logits.to(compute_dtype(logits.dtype)) / temperature
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        nan = torch.full((), float("nan"), dtype=x.dtype, device=x.device)
        if x.shape[-1] == 0:  # no token to gather: every row is ignored (0) or bad (NaN)
            out = torch.where(bad, nan, zero.expand(bad.shape))
            ent = out.clone() if return_entropy else None
        else:
            lse, logp_all, p = row_stats(x)
            out = torch.where(valid, logp_all.gather(-1, safe_ids.unsqueeze(-1)).squeeze(-1), zero)
            out = torch.where(bad, nan, out)
            ent = None
            if return_entropy:
                ent = torch.where(valid, entropy(p, logp_all), zero)
                ent = torch.where(bad, nan, ent)
        ctx.save_for_backward(logits, safe_ids, valid)
        ctx.temperature = temperature
        ctx.record = (requested, status, reason)
        return out, ent

    @staticmethod
    @second_order.refused("logp.backward")
    def backward(ctx, grad_logp, grad_ent):
        logits, safe_ids, valid = ctx.saved_tensors
        requested, status, reason = ctx.record  # the backward runs the backend of its forward
        if not torch.compiler.is_compiling():  # compiled: counted with the forward call (rlkernel.ops.logp)
            dispatch.record("logp.backward", requested, "native", status, reason)
        with op_range("op.logp.backward"):
            if logits.shape[-1] == 0:
                return (torch.zeros_like(logits),) + (None,) * 8
            t = ctx.temperature
            x = logits.to(compute_dtype(logits.dtype)) / t
            _, logp_all, p = row_stats(x)
            mask = valid.to(x.dtype).unsqueeze(-1)
            grad = torch.zeros_like(x)
            if grad_logp is not None:
                onehot = torch.zeros_like(x).scatter_(-1, safe_ids.unsqueeze(-1), 1.0)
                grad = grad + grad_logp.to(x.dtype).unsqueeze(-1) * (onehot - p)
            if grad_ent is not None:
                ent = entropy(p, logp_all).unsqueeze(-1)
                # dH/dx_j = -p_j (log p_j + H); 0 where p_j = 0
                term = torch.where(p > 0, p * (logp_all + ent), torch.zeros_like(p))
                grad = grad - grad_ent.to(x.dtype).unsqueeze(-1) * term
            # where, not a product: an ignored all -inf row has NaN terms and still gets no gradient
            grad = torch.where(mask > 0, grad / t, torch.zeros_like(grad)).to(logits.dtype)
        return grad, None, None, None, None, None, None, None, None


def logp_native(logits, token_ids, *, temperature, ignore_index, return_entropy, requested="native",
                fallback_reason="", keep_dtype=False):
    """Native log-probs: float32 (logp, entropy or None); ``keep_dtype`` keeps float64 for float64 logits
    (gradcheck needs it).

    The whole call, id checks and output casts included, runs inside ``op.logp.forward``: a native op range
    holds every kernel of its op (contracts, section 3)."""
    with op_range("op.logp.forward"):
        out, ent = _logp_native(logits, token_ids, temperature, ignore_index, return_entropy, requested,
                                fallback_reason)
        if not keep_dtype:
            out = out.float()
            ent = ent.float() if ent is not None else None
        return out, ent


def _logp_native(logits, token_ids, temperature, ignore_index, return_entropy, requested, fallback_reason,
                 report=True):
    """The forward of validated inputs (CPU ids were checked by rlkernel.validate). On CUDA a bad id gives NaN and,
    with ``report``, goes to the device error record by tensor ops on the stream: no host sync."""
    vocab = logits.shape[-1]
    ids = token_ids.long()
    valid = ids != ignore_index
    bad = valid & ((ids < 0) | (ids >= vocab))
    safe = torch.where(valid & ~bad, ids, torch.zeros_like(ids))
    valid = valid & ~bad
    status = "fallback" if fallback_reason else "native"
    out, ent = _NativeLogp.apply(logits, safe, valid, bad, float(temperature), bool(return_entropy), requested,
                                 status, fallback_reason)
    if report and logits.device.type == "cuda":
        address, seq, sync = errors.begin("logp.forward", logits.device, ids.shape, vocab)
        errors.note_native(errors.ERR_LOGP_BAD_ID, seq, address, logits.device, bad, ids)
        errors.after_call(logits.device, sync)
    return out, ent


def native_logp_values(logits, token_ids, temperature):
    """Float32 log-probs of the ids by the native forward arithmetic, without an op range, a dispatch record or an
    error report (the sampler calls it inside its own op range; its rows without a distribution, id -1, give NaN
    here and were reported by the sampler)."""
    with torch.no_grad():
        out, _ = _logp_native(logits, token_ids, temperature, -100, False, "native", "", report=False)
    return out.float()
