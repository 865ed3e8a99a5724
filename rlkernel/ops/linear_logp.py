"""rlkernel.linear_logp: per-token log-probs (and entropy) straight from hidden states and the LM head's weight.

``log_softmax((hidden @ weight.T + bias) / temperature)`` at the ids, without ever holding the N x V logits: the
native backend (``linear_logp_native``) works in token chunks, the fused one (``linear_logp_fused``) in tiles of a
bounded workspace. Conventions are those of ``rlkernel.logp`` (docs/contracts.md, section 1).
"""
from __future__ import annotations

import torch

from rlkernel import dispatch
from rlkernel.ops import blas, precision, row_mask, sharded
from rlkernel.ops.linear_options import OUTPUT_NAMES, LinearLogpOutput, check_options, fallback_for
from rlkernel.validate import check_linear_args, check_logits_dtype

OP = "linear_logp.forward"


def linear_logp(hidden: torch.Tensor, weight: torch.Tensor, token_ids: torch.Tensor | None, *, bias=None,
                temperature=1.0, ignore_index: int = -100, return_entropy: bool = False,
                softcap: float | None = None, logit_scale: float = 1.0, outputs=(),
                batch_invariant: bool = False, backend: str = "auto", require_fused: bool = False,
                logits_dtype: torch.dtype | None = None, mask: torch.Tensor | None = None,
                grad_accumulation: str = "float32", top_k=0, top_p=1.0, min_p=0.0, kept_ids=None,
                kept_offsets=None):
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

    Options (TRL's fused head, ``trl.kernels.ChunkedLogProbFunction``, has the same): ``temperature`` a number or
    a per-row tensor of shape ``hidden.shape[:-1]`` (or 0-dim); ``logit_scale`` and ``softcap`` transform the
    logits before the temperature, ``z' = softcap * tanh(z * logit_scale / softcap) / T``, with their gradients;
    ``token_ids=None`` with ``return_entropy=True``: the entropy alone; ``outputs``, names among "entropy",
    "log_sum_sq_probs" (log sum softmax(z')^2), "mean_logit" (mean of z') and "is_top1" (argmax z' == id):
    a ``LinearLogpOutput(logp, entropy, log_sum_sq_probs, mean_logit, is_top1)``, None for what is not asked, the
    three statistics without gradient. Fused: every option, the three statistics folded in the same pass as the
    softmax; a softcap keeps float32 logits there (as ``logits_dtype=torch.float32``).

    **Processed mode** (``top_k`` / ``top_p`` / ``min_p`` other than their defaults (numbers or per-row tensors),
    a temperature of 0, or a kept set; a per-row temperature alone is the plain mode above, T > 0): the log-prob
    under the filtered distribution ``rlkernel.sample`` draws from, as ``rlkernel.logp(hidden @ weight.T + bias,
    token_ids, same filters)`` gives it (``-inf`` off the kept set, 0 for a T = 0 row's argmax), the filtered
    entropy, a backward that holds the kept set fixed; never the N x V logits. ``kept_ids`` / ``kept_offsets``: the
    rollout's kept set as CSR (vLLM's ``return_sampling_mask``; row i keeps
    ``kept_ids[kept_offsets[i]:kept_offsets[i + 1]]``) instead of the filters (both: ``ValueError``). With
    ``batch_invariant=True`` bitwise ``rlkernel.logp(rlkernel.linear_logits(hidden, weight, bias), ...)``.
    """
    from rlkernel.ops import linear_logp_processed as proc

    acc = precision.check_grad_accumulation(grad_accumulation)  # both modes (the processed one does not use it yet)
    if proc.wants_processed(temperature, top_k, top_p, min_p, kept_ids, kept_offsets):
        proc.check_plain_options(softcap, logit_scale, outputs, token_ids, OP)
        if mask is not None:
            raise ValueError(f"{OP}: mask cannot be combined with the processed mode (top_k / top_p / min_p, "
                             f"temperature 0 or kept_ids) yet; give masked rows ignore_index instead")
        out, ent = proc.processed(hidden, weight, token_ids, bias=bias, temperature=temperature, top_k=top_k,
                                  top_p=top_p, min_p=min_p, kept_ids=kept_ids, kept_offsets=kept_offsets,
                                  ignore_index=ignore_index, return_entropy=return_entropy,
                                  batch_invariant=batch_invariant, backend=backend, require_fused=require_fused,
                                  logits_dtype=logits_dtype)
        return (out, ent) if return_entropy else out
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"batch_invariant must be a bool, got {type(batch_invariant).__name__}")
    logits32 = check_logits_dtype(logits_dtype)
    if token_ids is None and not return_entropy and not outputs:
        raise ValueError("token_ids=None gives no log-probs: ask for the entropy (return_entropy=True) or outputs")
    weight, bias = sharded.full(weight), sharded.full(bias)
    zero = sharded.zero3_partitioned(weight, bias)
    with sharded.gathered(zero):
        return _linear_logp(hidden, weight, token_ids, bias, temperature, ignore_index, bool(return_entropy),
                            softcap, logit_scale, outputs, batch_invariant, backend, require_fused, logits32, mask,
                            acc, zero)


def _linear_logp(hidden, weight, token_ids, bias, temperature, ignore_index, return_entropy, softcap, logit_scale,
                 outputs, batch_invariant, backend, require_fused, logits32, mask, acc, zero):
    check_linear_args(hidden, weight, token_ids, bias, temperature, ignore_index, OP)  # it reads CPU ids
    row_mask.check_mask(mask, hidden, OP)
    lead, idx = hidden.shape[:-1], None
    opts, names = None, ()
    cd = precision.compute_dtype(hidden, weight, bias)
    # the options on every row, before a mask compacts them: a bad per-row temperature is named by its own row (and
    # refused on a masked row too, as on an ignored one), a temperature of another shape refused as without a mask
    if _wants_options(temperature, softcap, logit_scale, outputs, token_ids):  # a CPU temperature tensor: its values
        opts, names = check_options(hidden, temperature, softcap, logit_scale, outputs, token_ids is not None, OP,
                                    compute=cd)
    if mask is not None:
        idx = row_mask.kept_rows(mask, hidden.device)
        if idx is None:  # a device mask under CUDA-graph capture: its rows ignored, no compaction
            if token_ids is None:
                raise ValueError(f"{OP}: token_ids=None with a device mask under CUDA-graph capture (its rows "
                                 f"would be ignored by their ids): give a CPU mask")
            token_ids = row_mask.as_ignored(token_ids, mask, int(ignore_index))
        else:
            hidden, token_ids = row_mask.compact(hidden, token_ids, idx)
            opts = row_mask.compact_options(opts, idx)  # a per-row temperature: its kept rows
    logits32 = logits32 and cd in blas.SIXTEEN_BIT  # float32 / float64 logits already are
    rec = (opts is not None and fallback_for(OP, opts, backend, require_fused, hidden.device, cd,
                                             batch_invariant=batch_invariant)
           or logits32 and blas.float32_fallback(OP, backend, require_fused, hidden.device, cd, batch_invariant)
           or dispatch.resolve(OP, backend, require_fused, hidden.device, cd))
    kwargs = dict(bias=bias, temperature=float(temperature) if opts is None else opts.temperature,
                  ignore_index=int(ignore_index), return_entropy=return_entropy or "entropy" in names,
                  batch_invariant=batch_invariant, requested=backend, logits32=logits32, compute=cd,
                  accumulation=acc, regather=zero)
    if rec.status == "fused":  # only calls whose options the kernels have get here (fallback_for)
        from rlkernel.ops.fused.linear_logp import linear_logp_fused

        ids, rows_opt = token_ids, None
        if opts is not None:  # the kernels' ids, temperature and per-row inputs, made before the op's range
            from rlkernel.ops.fused.linear_logp_options import prepare

            ids, kwargs["temperature"], rows_opt, capped = prepare(opts, hidden, token_ids, hidden.shape[:-1],
                                                                   weight.shape[0])
            kwargs["logits32"] = logits32 or (capped and cd in blas.SIXTEEN_BIT)
            if token_ids is None:  # prepare's ids are 0: no ignore_index may match them
                kwargs["ignore_index"] = -1
        lp, ent, *stats = linear_logp_fused(hidden, weight, ids, rows_opt=rows_opt, **kwargs)
        res = (lp if token_ids is not None else None, ent) + _asked(stats, names)
    else:
        from rlkernel.ops.native.linear_logp import linear_logp_native

        res = linear_logp_native(hidden, weight, token_ids, fallback_reason=rec.reason, opts=opts, **kwargs)
        res = tuple(res) + (None,) * (5 - len(res))
    if idx is not None:  # the kept rows back in place: masked rows 0 (False for is_top1), no gradient
        res = tuple(row_mask.scatter(v, idx, lead) for v in res)
    if outputs:
        return LinearLogpOutput(*res)
    if token_ids is None:
        return res[1]
    return (res[0], res[1]) if return_entropy else res[0]


def _asked(stats, names) -> tuple:
    """(log_sum_sq_probs, mean_logit, is_top1) of the fused fold (all three, or none), None for those not asked."""
    if not stats:
        return (None, None, None)
    return tuple(v if name in names else None for v, name in zip(stats, OUTPUT_NAMES[1:], strict=True))


def _wants_options(temperature, softcap, logit_scale, outputs, token_ids) -> bool:
    """Whether the call uses any option of rlkernel.ops.linear_options (else today's path, unchanged: a plain call
    pays for none of their checks)."""
    return (isinstance(temperature, torch.Tensor) or softcap is not None or outputs != ()
            or not (type(logit_scale) is float and logit_scale == 1.0) or token_ids is None)
