"""rlkernel.linear_logp: per-token log-probs (and entropy) straight from hidden states and the LM head's weight.

``log_softmax((hidden @ weight.T + bias) / temperature)`` at the ids, without ever holding the N x V logits: the
native backend (``linear_logp_native``) works in token chunks, the fused one (``linear_logp_fused``) in tiles of a
bounded workspace. Conventions are those of ``rlkernel.logp`` (docs/contracts.md, section 1).
"""
from __future__ import annotations

import torch

from rlkernel import dispatch
from rlkernel.ops import blas
from rlkernel.validate import check_linear_args, check_logits_dtype

OP = "linear_logp.forward"


def linear_logp(hidden: torch.Tensor, weight: torch.Tensor, token_ids: torch.Tensor, *, bias=None,
                temperature: float = 1.0, ignore_index: int = -100, return_entropy: bool = False,
                batch_invariant: bool = False, backend: str = "auto", require_fused: bool = False,
                logits_dtype: torch.dtype | None = None, top_k=0, top_p=1.0, min_p=0.0, kept_ids=None,
                kept_offsets=None):
    """``log_softmax((hidden @ weight.T + bias) / temperature)`` at ``token_ids``: float32, shape
    ``hidden.shape[:-1]``; with ``return_entropy=True`` a tuple ``(logp, entropy)``. Gradients flow to hidden,
    weight and bias.

    ``hidden [..., H]``, ``weight [V, H]`` (the LM head's layout), ``bias [V]`` or None, all of one dtype and
    device. The logits are the matmul's result in that dtype (as ``hidden @ weight.T`` gives them), upcast to
    float32 for the softmax; ``logits_dtype=torch.float32``: the logits of 16-bit inputs stay float32 from the
    GEMM's accumulator on (never rounded to 16 bits), for the values and the gradient's softmax terms (float32 or
    float64 inputs: no change). Rows whose id is ``ignore_index`` give 0 and no gradient. ``batch_invariant=True``:
    a row's results (logp, entropy, its hidden gradient) are bitwise the same whatever the number of rows and
    wherever the row sits (fixed tile shapes and reduction order; slower for few rows). ``backend``: "auto",
    "fused" or "native", as for ``rlkernel.logp``. On CUDA nothing waits for the GPU: an id outside [0, V) gives
    NaN (and NaN gradients) and goes to the device error record (``rlkernel.check_errors``); on CPU it raises
    ``IndexError`` at once.

    **Processed mode** (``top_k`` / ``top_p`` / ``min_p`` other than their defaults, any per-row tensor setting,
    temperature 0, or a kept set): the log-prob under the filtered distribution ``rlkernel.sample`` draws from, as
    ``rlkernel.logp(hidden @ weight.T + bias, token_ids, same filters)`` gives it (``-inf`` off the kept set, 0 for
    a T = 0 row's argmax), the filtered entropy, a backward that holds the kept set fixed; never the N x V logits.
    ``kept_ids`` / ``kept_offsets``: the rollout's kept set as CSR (vLLM's ``return_sampling_mask``; row i keeps
    ``kept_ids[kept_offsets[i]:kept_offsets[i + 1]]``) instead of the filters (both: ``ValueError``). With
    ``batch_invariant=True`` bitwise ``rlkernel.logp(rlkernel.linear_logits(hidden, weight, bias), ...)``. See
    docs/contracts.md.
    """
    from rlkernel.ops import linear_logp_processed as proc

    if proc.wants_processed(temperature, top_k, top_p, min_p, kept_ids, kept_offsets):
        out, ent = proc.processed(hidden, weight, token_ids, bias=bias, temperature=temperature, top_k=top_k,
                                  top_p=top_p, min_p=min_p, kept_ids=kept_ids, kept_offsets=kept_offsets,
                                  ignore_index=ignore_index, return_entropy=return_entropy,
                                  batch_invariant=batch_invariant, backend=backend, require_fused=require_fused,
                                  logits_dtype=logits_dtype)
        return (out, ent) if return_entropy else out
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"batch_invariant must be a bool, got {type(batch_invariant).__name__}")
    logits32 = check_logits_dtype(logits_dtype)
    check_linear_args(hidden, weight, token_ids, bias, temperature, ignore_index, OP)  # last: it reads CPU ids
    logits32 = logits32 and hidden.dtype in blas.SIXTEEN_BIT  # float32 / float64 logits already are
    rec = (logits32 and blas.float32_fallback(OP, backend, require_fused, hidden.device, hidden.dtype, batch_invariant)
           or dispatch.resolve(OP, backend, require_fused, hidden.device, hidden.dtype))
    kwargs = dict(bias=bias, temperature=float(temperature), ignore_index=int(ignore_index),
                  return_entropy=bool(return_entropy), batch_invariant=batch_invariant, requested=backend,
                  logits32=logits32)
    if rec.status == "fused":
        from rlkernel.ops.fused.linear_logp import linear_logp_fused

        out, ent = linear_logp_fused(hidden, weight, token_ids, **kwargs)
    else:
        from rlkernel.ops.native.linear_logp import linear_logp_native

        out, ent = linear_logp_native(hidden, weight, token_ids, fallback_reason=rec.reason, **kwargs)
    return (out, ent) if return_entropy else out
