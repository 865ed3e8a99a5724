"""rlkernel.linear_logp's processed mode: the checks and the backend choice behind its ``top_k`` / ``top_p`` /
``min_p`` (numbers or per-row tensors) and ``kept_ids`` / ``kept_offsets`` arguments, shared with
``rlkernel.linear_logp_loss`` (docs/contracts.md, section 1).

The processed log-prob of a token is log p_i - log S under the kept set ``rlkernel.sample`` draws from (S its
mass), computed from hidden states without the N x V logits: natively by token chunks
(``native.linear_logp_processed``), fused by row blocks of GEMM logits fed to ``rlkernel.logp``'s processed
kernels (``fused.linear_logp_processed``). The chunk GEMM is ``rlkernel.linear_logits``'s on both paths.
"""
from __future__ import annotations

import math

import torch

from rlkernel import dispatch
from rlkernel.ops import blas, precision, sharded
from rlkernel.ops.linear_logits import logits_rows
from rlkernel.ops.linear_logp_loss_chunks import check_loss_output
from rlkernel.ops.native.linear_logp_processed import csr_rows, linear_logp_processed_native
from rlkernel.validate import _raise_cpu_faults, _settings, check_linear_args, check_logits_dtype

OP = "linear_logp.forward"


def _given(value, default) -> bool:
    return isinstance(value, torch.Tensor) or value != default


def wants_processed(temperature, top_k, top_p, min_p, kept_ids, kept_offsets) -> bool:
    """Whether a linear_logp call is in processed mode: a filter other than its default (a per-row filter tensor
    included), a temperature of 0, or a kept set. A per-row temperature alone is not: the plain mode takes it (T > 0
    on every row; a trainer's per-token temperature, verl's case, stays on the plain kernels). Reads no tensor's
    values."""
    if kept_ids is not None or kept_offsets is not None:
        return True
    if not isinstance(temperature, torch.Tensor) and isinstance(temperature, (int, float)) and temperature == 0:
        return True
    return _given(top_k, 0) or _given(top_p, 1.0) or _given(min_p, 0.0)


def check_plain_options(softcap, logit_scale, outputs, token_ids, op: str) -> None:
    """Processed mode has none of the plain mode's logit transforms or extra outputs (yet): say so at once."""
    given = [name for name, on in (("softcap", softcap is not None), ("logit_scale", logit_scale != 1.0),
                                   ("outputs", bool(outputs)), ("token_ids=None", token_ids is None)) if on]
    if given:
        raise ValueError(f"{op}: {', '.join(given)} cannot be combined with the processed mode (top_k / top_p / "
                         f"min_p, temperature 0 or kept_ids); use one or the other")


def _check_csr(kept_ids, kept_offsets, n: int, vocab: int, device, filters_given: bool, op: str) -> None:
    if kept_ids is None or kept_offsets is None:
        raise ValueError(f"{op}: kept_ids and kept_offsets go together (the CSR kept set: row i keeps "
                         f"kept_ids[kept_offsets[i]:kept_offsets[i + 1]]); got only one")
    if filters_given:
        raise ValueError(f"{op}: kept_ids / kept_offsets (the rollout's kept set) replace top_k / top_p / min_p; "
                         f"give one or the other, not both")
    for name, t in (("kept_ids", kept_ids), ("kept_offsets", kept_offsets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype.is_floating_point or t.dtype in (torch.bool, torch.uint64) or t.is_complex():
            raise TypeError(f"{name} must be an integer tensor that int64 holds, got {t.dtype}")
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"{name} on {t.device} but hidden on {device}: must be on one device")
    if kept_offsets.shape[0] != n + 1:
        raise ValueError(f"{op}: kept_offsets must have rows + 1 = {n + 1} entries, got {kept_offsets.shape[0]}")
    if device.type == "cpu" and not torch.compiler.is_compiling():  # values too: no sync to fear
        off = kept_offsets.long()
        if int(off[0]) != 0 or int(off[-1]) != kept_ids.numel() or bool((off[1:] < off[:-1]).any()):
            raise ValueError(f"{op}: kept_offsets must rise from 0 to len(kept_ids) = {kept_ids.numel()}, got "
                             f"{off.tolist()[:8]}{'...' if off.numel() > 8 else ''}")
        ids = kept_ids.long()
        out = (ids < 0) | (ids >= vocab)
        if bool(out.any()):
            first = int(out.nonzero()[0])
            raise ValueError(f"{op}: kept_ids[{first}] = {int(ids[first])} is outside [0, {vocab})")


def check_processed_args(hidden, weight, token_ids, bias, temperature, ignore_index, top_k, top_p, min_p,
                         kept_ids, kept_offsets, op: str = OP):
    """Every argument, before any work: (RowSettings, csr or None). On CUDA metadata only (no host sync)."""
    # the temperature is checked below with the filters (0 and per-row tensors are allowed here)
    check_linear_args(hidden, weight, token_ids, bias, 1.0, ignore_index, op)
    n, vocab = math.prod(hidden.shape[:-1]), weight.shape[0]
    like = torch.empty((), device=hidden.device).expand(*hidden.shape[:-1], vocab)  # logits' shape, no storage
    csr = None
    if kept_ids is not None or kept_offsets is not None:
        _check_csr(kept_ids, kept_offsets, n, vocab, hidden.device,
                   _given(top_k, 0) or _given(top_p, 1.0) or _given(min_p, 0.0), op)
        settings = _settings(like, temperature, 0, 1.0, 0.0)
        csr = csr_rows(kept_ids, kept_offsets, n)
    else:
        settings = _settings(like, temperature, top_k, top_p, min_p)
    if hidden.device.type == "cpu" and not torch.compiler.is_compiling():
        _raise_cpu_faults(op, settings, like, (temperature, top_k, top_p, min_p))
    return settings, csr


def processed(hidden, weight, token_ids, *, bias, temperature, top_k, top_p, min_p, kept_ids, kept_offsets,
              ignore_index, return_entropy, batch_invariant, backend, require_fused, logits_dtype, op=OP,
              keep_dtype=False):
    """(logp, entropy or None) of rlkernel.linear_logp's processed mode: checks, one dispatch record ``op``, one
    backend. float32, or float64 for float64 inputs with ``keep_dtype`` (the loss's contract; the fused path takes
    no float64)."""
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"batch_invariant must be a bool, got {type(batch_invariant).__name__}")
    logits32 = check_logits_dtype(logits_dtype)
    weight, bias = sharded.full(weight), sharded.full(bias)  # a DTensor (FSDP2): gathered, differentiable
    if sharded.zero3_partitioned(weight, bias):
        raise ValueError(f"{op}: a partitioned ZeRO-3 weight or bias cannot be used with the processed mode (top_k / "
                         f"top_p / min_p, temperature 0 or kept_ids) yet (its backward recomputes the logits); "
                         f"gather it (deepspeed.zero.GatheredParameters) around the call")
    settings, csr = check_processed_args(hidden, weight, token_ids, bias, temperature, ignore_index, top_k, top_p,
                                         min_p, kept_ids, kept_offsets, op)
    # mixed dtypes: the GEMMs in the compute dtype (rlkernel.ops.precision), by differentiable casts, so each
    # gradient comes back in its input's dtype and the backward's recomputed logits (and kept set) are the forward's
    cd = precision.compute_dtype(hidden, weight, bias)
    hidden, weight, bias = (precision.cast(t, cd) for t in (hidden, weight, bias))
    logits32 = logits32 and hidden.dtype in blas.SIXTEEN_BIT
    rec = (logits32 and blas.float32_fallback(op, backend, require_fused, hidden.device, hidden.dtype,
                                              batch_invariant)
           or dispatch.resolve(op, backend, require_fused, hidden.device, hidden.dtype))
    if rec.status == "fused":
        from rlkernel.ops.fused.linear_logp_processed import linear_logp_processed_fused

        return linear_logp_processed_fused(hidden, weight, token_ids, bias=bias, settings=settings, csr=csr,
                                           ignore_index=int(ignore_index), return_entropy=bool(return_entropy),
                                           batch_invariant=batch_invariant, requested=backend, logits32=logits32)

    def gemm(rows):
        return logits_rows(rows, weight, bias, batch_invariant, logits32)

    return linear_logp_processed_native(hidden, weight, token_ids, bias=bias, gemm=gemm, settings=settings, csr=csr,
                                        ignore_index=int(ignore_index), return_entropy=bool(return_entropy),
                                        batch_invariant=batch_invariant, requested=backend,
                                        fallback_reason=rec.reason, keep_dtype=keep_dtype)


def processed_loss(hidden, weight, token_ids, loss_fn, *, bias, temperature, top_k, top_p, min_p, ignore_index,
                   reduction, chunk_size, backend, require_fused, logits_dtype):
    """rlkernel.linear_logp_loss with filters (its loss-only arguments checked by the caller): the processed
    log-probs and filtered entropy of every token by ``processed`` (token chunks / row blocks inside, never N x V;
    one ``linear_logp_loss`` dispatch record, and ``linear_logp.backward`` when the loss is backpropagated), then
    ``loss_fn`` per ``chunk_size`` tokens (all of them at once by default) and the reduction. Plain autograd:
    the backward recomputes the logits (one more GEMM per block than the plain loss's single pass)."""
    lp, ent = processed(hidden, weight, token_ids, bias=bias, temperature=temperature, top_k=top_k, top_p=top_p,
                        min_p=min_p, kept_ids=None, kept_offsets=None, ignore_index=ignore_index,
                        return_entropy=True, batch_invariant=False, backend=backend, require_fused=require_fused,
                        logits_dtype=logits_dtype, op="linear_logp_loss", keep_dtype=True)
    lp, ent = lp.reshape(-1), ent.reshape(-1)
    n = lp.numel()
    valid = token_ids.reshape(-1) != ignore_index
    step = n if chunk_size is None else int(chunk_size)
    parts = []
    for c0 in range(0, n, max(step, 1)):
        lp_c = lp[c0:c0 + step]
        out = loss_fn(lp_c, ent[c0:c0 + step], slice(c0, min(n, c0 + step)))
        check_loss_output(out, lp_c)  # as the plain loss checks it: a scalar would broadcast, silently scaled
        parts.append(out)
    per = torch.cat(parts) if parts else lp.new_zeros(0)
    total = torch.where(valid, per, torch.zeros_like(per)).sum()
    if reduction == "mean":
        total = total / valid.sum().clamp(min=1).to(total.dtype)
    return total
