"""rlkernel.linear_logp: per-token log-probs (and entropy) straight from hidden states and the LM head's weight.

``log_softmax((hidden @ weight.T + bias) / temperature)`` at the ids, without ever holding the N x V logits: the
native backend (``linear_logp_native``) works in token chunks, the fused one (``linear_logp_fused``) in tiles of a
bounded workspace. Conventions are those of ``rlkernel.logp`` (docs/contracts.md, section 1).
"""
from __future__ import annotations

import torch

from rlkernel import dispatch
from rlkernel.ops import blas, precision, row_mask, sharded
from rlkernel.validate import check_linear_args, check_logits_dtype

OP = "linear_logp.forward"


def linear_logp(hidden: torch.Tensor, weight: torch.Tensor, token_ids: torch.Tensor, *, bias=None,
                temperature: float = 1.0, ignore_index: int = -100, return_entropy: bool = False,
                batch_invariant: bool = False, backend: str = "auto", require_fused: bool = False,
                logits_dtype: torch.dtype | None = None, mask: torch.Tensor | None = None,
                grad_accumulation: str = "float32"):
    """``log_softmax((hidden @ weight.T + bias) / temperature)`` at ``token_ids``: float32, shape
    ``hidden.shape[:-1]``; with ``return_entropy=True`` a tuple ``(logp, entropy)``. Gradients flow to hidden,
    weight and bias.

    ``hidden [..., H]``, ``weight [V, H]`` (the LM head's layout), ``bias [V]`` or None, on one device, in any
    floating dtypes: the GEMMs run in one compute dtype (``rlkernel.ops.precision``: the autocast dtype under
    ``torch.autocast``, else the inputs' common dtype or the lowest-precision one, e.g. bf16 hidden + float32
    weight -> bf16), forward and backward, and each gradient comes back in its input's dtype;
    ``grad_accumulation``: "float32" (default) or "input" (the weight's dtype) for dW / db. ``mask``: a bool
    tensor of ``hidden.shape[:-1]``, False rows skipped (no GEMM work; ``rlkernel.ops.row_mask``: a CPU mask
    costs no host sync, a device mask one), 0 and no gradient. A DTensor weight (FSDP2) is gathered once per call, a
    partitioned ZeRO-3 one in the forward and in the backward (``rlkernel.ops.sharded``). The logits are the
    matmul's result in the compute dtype (as ``hidden @ weight.T`` gives them), upcast to
    float32 for the softmax; ``logits_dtype=torch.float32``: the logits of 16-bit inputs stay float32 from the
    GEMM's accumulator on (never rounded to 16 bits), for the values and the gradient's softmax terms (float32 or
    float64 inputs: no change). Rows whose id is ``ignore_index`` give 0 and no gradient. ``batch_invariant=True``:
    a row's results (logp, entropy, its hidden gradient) are bitwise the same whatever the number of rows and
    wherever the row sits (fixed tile shapes and reduction order; slower for few rows). ``backend``: "auto",
    "fused" or "native", as for ``rlkernel.logp``. On CUDA nothing waits for the GPU: an id outside [0, V) gives
    NaN (and NaN gradients) and goes to the device error record (``rlkernel.check_errors``); on CPU it raises
    ``IndexError`` at once. See docs/contracts.md.
    """
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"batch_invariant must be a bool, got {type(batch_invariant).__name__}")
    logits32 = check_logits_dtype(logits_dtype)
    acc = precision.check_grad_accumulation(grad_accumulation)
    weight, bias = sharded.full(weight), sharded.full(bias)
    zero = sharded.zero3_partitioned(weight, bias)
    with sharded.gathered(zero):
        return _linear_logp(hidden, weight, token_ids, bias, temperature, ignore_index, bool(return_entropy),
                            batch_invariant, backend, require_fused, logits32, mask, acc, zero)


def _linear_logp(hidden, weight, token_ids, bias, temperature, ignore_index, return_entropy, batch_invariant,
                 backend, require_fused, logits32, mask, acc, zero):
    check_linear_args(hidden, weight, token_ids, bias, temperature, ignore_index, OP)  # it reads CPU ids
    row_mask.check_mask(mask, hidden, OP)
    cd = precision.compute_dtype(hidden, weight, bias)
    logits32 = logits32 and cd in blas.SIXTEEN_BIT  # float32 / float64 logits already are
    rec = (logits32 and blas.float32_fallback(OP, backend, require_fused, hidden.device, cd, batch_invariant)
           or dispatch.resolve(OP, backend, require_fused, hidden.device, cd))
    lead, idx = hidden.shape[:-1], None
    if mask is not None:
        idx = row_mask.kept_rows(mask, hidden.device)
        if idx is None:  # a device mask under CUDA-graph capture: its rows ignored, no compaction
            token_ids = row_mask.as_ignored(token_ids, mask, int(ignore_index))
        else:
            hidden, token_ids = row_mask.compact(hidden, token_ids, idx)
    kwargs = dict(bias=bias, temperature=float(temperature), ignore_index=int(ignore_index),
                  return_entropy=return_entropy, batch_invariant=batch_invariant, requested=backend,
                  logits32=logits32, compute=cd, accumulation=acc, regather=zero)
    if rec.status == "fused":
        from rlkernel.ops.fused.linear_logp import linear_logp_fused

        out, ent = linear_logp_fused(hidden, weight, token_ids, **kwargs)
    else:
        from rlkernel.ops.native.linear_logp import linear_logp_native

        out, ent = linear_logp_native(hidden, weight, token_ids, fallback_reason=rec.reason, **kwargs)
    if idx is not None:
        out, ent = row_mask.scatter(out, idx, lead), row_mask.scatter(ent, idx, lead)
    return (out, ent) if return_entropy else out
