"""The native processed log-probs of rlkernel.logp: log-probs under the filtered, renormalised distribution.

``log p_i - log S`` (S = the kept mass) for a kept id, ``-inf`` for any other; T = 0 rows: 0 for the argmax, -inf
otherwise; entropy of the filtered distribution. The backward holds the kept set fixed: the gradient of
``z_i / T - logsumexp`` over the kept set, 0 outside it, 0 for a whole row whose id is not kept (docs/contracts.md,
section 1). The kept set comes from rlkernel.ops.native.filters, which the native sampler uses too.
"""
from __future__ import annotations

import torch

from rlkernel import dispatch, errors
from rlkernel.nvtx_ranges import op_range
from rlkernel.ops import second_order
from rlkernel.ops.native.filters import Filtered, row_sum
from rlkernel.validate import RowSettings, row_faults


def _entropy(q: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """The filtered law's entropy, summed in row_sum's fixed order (batch invariance), not softmax.entropy's."""
    return -row_sum(torch.where(q > 0, q * logq, torch.zeros_like(q)))


def processed_values(f, safe_ids, valid, bad, return_entropy):
    """(out [N], entropy [N] or None, bad [N]) of the kept set ``f`` (a ``Filtered``, or anything with its ``x``,
    ``m``, ``log_s``, ``kept``, ``greedy``, ``kept_probs()`` and ``no_distribution()``) at ``safe_ids`` [N]. ``bad``
    comes back with the rows without a distribution added (NaN, and NaN gradients from ``processed_grad``); an
    ignored row (not ``valid``) stays 0. Shared with rlkernel.linear_logp's processed mode: the same bits."""
    n = safe_ids.numel()
    # a row without a distribution (a NaN, no finite logit, at T > 0 a +inf one) is NaN, as on the plain path;
    # saved with the bad rows, so its gradient is NaN too (an ignored row stays 0)
    bad = bad | (valid & f.no_distribution())
    ids = safe_ids.view(n, 1)
    kept_id = f.kept.gather(-1, ids).view(n)
    logq = f.x - f.m - f.log_s  # log q over the row (meaningful on the kept set)
    nan = torch.full((), float("nan"), dtype=logq.dtype, device=logq.device)
    zero = torch.zeros((), dtype=logq.dtype, device=logq.device)
    out = torch.where(f.greedy, zero, logq.gather(-1, ids).view(n))
    out = torch.where(kept_id, out, torch.full_like(out, float("-inf")))
    out = torch.where(bad, nan, torch.where(valid, out, zero))
    ent = None
    if return_entropy:
        ent = torch.where(f.greedy, zero, _entropy(f.kept_probs(), logq))
        ent = torch.where(bad, nan, torch.where(valid, ent, zero))
    return out, ent, bad


def processed_grad(f, safe_ids, valid, bad, grad_logp, grad_ent):
    """d loss / d logits [N, V] (compute dtype) for the kept set ``f`` held fixed: ``grad_logp`` / ``grad_ent`` ([N]
    or None) the incoming gradients; 0 for ignored and T = 0 rows and off the kept set, NaN on ``bad`` rows."""
    n = safe_ids.numel()
    ids = safe_ids.view(n, 1)
    kept_id = f.kept.gather(-1, ids)
    q = f.kept_probs()
    live = (valid & ~f.greedy).view(n, 1)  # T = 0 rows are constant: no gradient
    grad = torch.zeros_like(q)
    if grad_logp is not None:
        onehot = torch.zeros_like(q).scatter_(-1, ids, 1.0)
        g = grad_logp.reshape(n, 1).to(q.dtype)
        grad = grad + torch.where(kept_id, g * (onehot - q), torch.zeros_like(q))
    if grad_ent is not None:
        logq = f.x - f.m - f.log_s
        h = _entropy(q, logq).unsqueeze(-1)
        # dH/dx_j = -q_j (log q_j + H) on the kept set
        term = torch.where(q > 0, q * (logq + h), torch.zeros_like(q))
        grad = grad - grad_ent.reshape(n, 1).to(q.dtype) * term
    grad = torch.where(live, grad * f.scale, torch.zeros_like(grad))  # d x / d logits = 1 / T
    return torch.where(bad.view(n, 1), torch.full_like(grad, float("nan")), grad)


class _ProcessedLogp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, safe_ids, valid, bad, settings, return_entropy, record):
        n, vocab = safe_ids.numel(), logits.shape[-1]
        f = Filtered(logits.reshape(n, vocab), *settings)
        out, ent, bad = processed_values(f, safe_ids, valid, bad, return_entropy)
        ctx.save_for_backward(logits, safe_ids, valid, bad)
        ctx.settings, ctx.record = settings, record
        return out, ent

    @staticmethod
    @second_order.refused("logp.backward")
    def backward(ctx, grad_logp, grad_ent):
        logits, safe_ids, valid, bad = ctx.saved_tensors
        requested, status, reason = ctx.record  # the backward runs the backend of its forward
        if not torch.compiler.is_compiling():
            dispatch.record("logp.backward", requested, "native", status, reason)
        with op_range("op.logp.backward"):
            n, vocab = safe_ids.numel(), logits.shape[-1]
            if vocab == 0:
                return (torch.zeros_like(logits),) + (None,) * 6
            f = Filtered(logits.reshape(n, vocab), *ctx.settings)  # the same kept set as the forward, bit for bit
            grad = processed_grad(f, safe_ids, valid, bad, grad_logp, grad_ent)
        return (grad.to(logits.dtype).view(logits.shape),) + (None,) * 6


def _forward(logits, token_ids, settings: RowSettings, ignore_index, return_entropy, record, report):
    vocab = logits.shape[-1]
    ids = token_ids.long().reshape(-1)
    valid = ids != ignore_index
    bad_id = valid & ((ids < 0) | (ids >= vocab))
    faults = row_faults(settings)
    bad = bad_id if faults is None else bad_id | (valid & faults[0])
    safe = torch.where(valid & ~bad_id, ids, torch.zeros_like(ids))
    valid = valid & ~bad
    if vocab == 0:  # no token to gather: every row is ignored (0) or bad (NaN)
        out = torch.where(bad, float("nan"), torch.zeros(bad.shape, dtype=torch.float32, device=logits.device))
        out, ent = out, (out.clone() if return_entropy else None)
    else:
        out, ent = _ProcessedLogp.apply(logits, safe, valid, bad, settings, bool(return_entropy), record)
    if report and logits.device.type == "cuda":
        address, seq, sync = errors.begin("logp.forward", logits.device, token_ids.shape, vocab)
        if faults is not None:  # a bad setting is reported on any row, ignored or not, as the CPU check raises
            errors.note_native(errors.ERR_BAD_ARG, seq, address, logits.device, faults[0], faults[1])
        errors.note_native(errors.ERR_LOGP_BAD_ID, seq, address, logits.device, bad_id, ids)
        errors.after_call(logits.device, sync)
    shape = token_ids.shape
    return out.reshape(shape), (ent.reshape(shape) if ent is not None else None)


def logp_processed_native(logits, token_ids, *, settings: RowSettings, ignore_index, return_entropy,
                          requested="native", fallback_reason="", keep_dtype=False):
    """Processed log-probs (and filtered entropy) of validated inputs: float32, or float64 for float64 logits with
    ``keep_dtype``. The whole call runs inside ``op.logp.forward``. On CUDA a bad id or setting gives NaN and goes
    to the device error record by tensor ops on the stream (no host sync)."""
    status = "fallback" if fallback_reason else "native"
    with op_range("op.logp.forward"):
        out, ent = _forward(logits, token_ids, settings, ignore_index, return_entropy,
                            (requested, status, fallback_reason), True)
        if not keep_dtype:
            out = out.float()
            ent = ent.float() if ent is not None else None
        return out, ent


def processed_logp_values(rows, ids, settings: RowSettings):
    """Float32 processed log-probs of ``ids`` (flat [N]) by the same arithmetic as ``logp_processed_native``,
    without an op range, a dispatch record or an error report: the sampler's ``return_logprobs="processed"`` (its
    rows without a distribution, id -1, give NaN; the sampler reported them)."""
    with torch.no_grad():
        out, _ = _forward(rows, ids, settings, -100, False, ("native", "native", ""), False)
    return out.float()
