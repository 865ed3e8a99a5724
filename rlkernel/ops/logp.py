"""rlkernel.logp: per-token log-probs (and entropy) from logits, on the fused CUDA path or the native one; plain, or
processed (under the filtered distribution a sampler drew from)."""
from __future__ import annotations

import torch

from rlkernel import dispatch
from rlkernel.ops.fused.logp import logp_fused
from rlkernel.ops.fused.logp_processed import logp_processed_fused
from rlkernel.ops.native.logp import logp_native
from rlkernel.ops.native.logp_processed import logp_processed_native
from rlkernel.validate import check_logp_args


def logp(logits: torch.Tensor, token_ids: torch.Tensor, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
         ignore_index: int = -100, return_entropy: bool = False, inplace_backward: bool = False,
         backend: str = "auto", require_fused: bool = False):
    """``log_softmax(logits / temperature)`` at ``token_ids``, float32, shape ``logits.shape[:-1]``.

    With a filter (``top_k`` in (0, V), ``top_p < 1``, ``min_p > 0``, temperature 0, or any of them a per-row
    tensor of shape ``logits.shape[:-1]``) the **processed** log-prob instead: log p_i - log S under the kept set
    ``rlkernel.sample`` draws from (S = its mass), -inf for an id outside it; T = 0 rows give 0 for the argmax and
    -inf otherwise; the entropy is the filtered distribution's; the backward holds the kept set fixed.

    With ``return_entropy=True`` returns ``(logp, entropy)``. Rows whose id is ``ignore_index`` give 0 and no
    gradient. ``inplace_backward=True`` lets the fused backend write the gradient into the logits' storage:
    the logits are overwritten during backward. ``backend``: "auto" (fused when it can run, else a recorded
    fallback), "fused" (raise FusedKernelUnavailable when it cannot), "native". On CUDA nothing here waits for the
    GPU: an id outside [0, V), or a per-row setting out of range, gives NaN and goes to the device error record
    (``rlkernel.check_errors``). See docs/contracts.md.
    """
    settings = check_logp_args(logits, token_ids, temperature, ignore_index, top_k, top_p, min_p)
    rec = dispatch.resolve("logp.forward", backend, require_fused, logits.device, logits.dtype)
    if torch.compiler.is_compiling() and torch.is_grad_enabled() and logits.requires_grad:
        # compiled code runs no Python in its backward: the backward's record is counted with the forward call
        dispatch.record("logp.backward", backend, rec.backend, rec.status, rec.reason)
    if settings.filtered(logits.shape[-1]):
        if rec.status == "fused":
            out, ent = logp_processed_fused(
                logits, token_ids, temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p,
                min_p=settings.min_p, ignore_index=int(ignore_index), return_entropy=bool(return_entropy),
                requested=backend)
        else:
            out, ent = logp_processed_native(logits, token_ids, settings=settings, ignore_index=int(ignore_index),
                                             return_entropy=bool(return_entropy), requested=backend,
                                             fallback_reason=rec.reason)
    elif rec.status == "fused":
        out, ent = logp_fused(logits, token_ids, temperature=float(temperature), ignore_index=int(ignore_index),
                              return_entropy=bool(return_entropy), inplace_backward=bool(inplace_backward),
                              requested=backend)
    else:
        out, ent = logp_native(logits, token_ids, temperature=float(temperature), ignore_index=int(ignore_index),
                               return_entropy=bool(return_entropy), requested=backend, fallback_reason=rec.reason)
    return (out, ent) if return_entropy else out
