"""The fused CUDA backend of the processed log-probs (rlkernel.logp with filters): fakes, autograd, the call.

Ops (csrc/sampling_op.cpp; kernels: the sampler's own, csrc/include/rlkernel/sampling_kernels.cuh, in stats mode,
and sampling_processed.cuh for the backward):

- ``torch.ops.rlkernel.logp_processed_forward(logits[N, V], ids[N], temperature, top_k, top_p, min_p,
  temperature_rows, top_k_rows, top_p_rows, min_p_rows, ignore_index, compute_entropy, error_record=0,
  error_seq=0, error_op=1, requested="fused") -> (logp[N], entropy[N] or [0], stats[N, 4], threshold[N] int64)``:
  the kept set of each row found by the sampler's filter code (so ``rlkernel.sample(..., return_logprobs=
  "processed")`` and this agree bit for bit), S summed in 2^-40 fixed point (the same bits whatever the batch).
  stats = (s_max, log S, entropy, 1/T; 1/T = 0 on an argmax row), threshold = the kept set's last packed
  (key, id): both saved for the backward, which holds the kept set fixed.
- ``logp_processed_backward(grad_logp?, grad_entropy?, logits, ids, stats, threshold, ignore_index) -> grad``.
"""
from __future__ import annotations

import contextlib

import torch

from rlkernel import _ext, dispatch, errors
from rlkernel.ops import second_order
from rlkernel.ops.rows import as_lead, as_rows, flat_ids, report_as_logp_call, row_grad, split_setting

_registered = False
_FORWARD = None
_BELOW_AUTOGRAD = torch._C._AutoDispatchBelowAutograd


def _fwd_fake(logits, token_ids, temperature, top_k, top_p, min_p, temperature_rows, top_k_rows, top_p_rows,
              min_p_rows, ignore_index, compute_entropy, error_record=0, error_seq=0, error_op=1, requested="fused"):
    n = logits.shape[0]
    f32 = dict(dtype=torch.float32, device=logits.device)
    return (torch.empty((n,), **f32), torch.empty((n if compute_entropy else 0,), **f32),
            torch.empty((n, 4), **f32), torch.empty((n,), dtype=torch.int64, device=logits.device))


def _bwd_fake(grad_logp, grad_entropy, logits, token_ids, stats, threshold, ignore_index):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


_N_INPUTS = 16  # inputs of logp_processed_forward


def _setup_context(ctx, inputs, output):
    logits, ids = inputs[0], inputs[1]
    ctx.ignore_index, ctx.compute_entropy, ctx.requested = inputs[10], inputs[11], inputs[15]
    _, _, stats, threshold = output
    ctx.mark_non_differentiable(stats, threshold)
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no entropy term in the kernel
    ctx.save_for_backward(logits, ids, stats, threshold)


@second_order.refused("logp.backward")
def _backward(ctx, grad_logp, grad_entropy, grad_stats, grad_threshold):
    logits, ids, stats, threshold = ctx.saved_tensors
    if not ctx.compute_entropy or (grad_entropy is not None and grad_entropy.numel() == 0):
        grad_entropy = None
    if grad_logp is None and grad_entropy is None:
        return (None,) * _N_INPUTS
    if not torch.compiler.is_compiling():  # compiled: counted with the forward call (rlkernel.ops.logp)
        dispatch.record("logp.backward", ctx.requested, "fused", "fused")
    grad = torch.ops.rlkernel.logp_processed_backward(row_grad(grad_logp), row_grad(grad_entropy), logits, ids,
                                                       stats, threshold, ctx.ignore_index)
    return (grad,) + (None,) * (_N_INPUTS - 1)


def ensure_registered() -> None:
    """Load rlkernel._C (raises rlkernel._ext.ExtensionNotBuilt) and register fakes and autograd once."""
    global _registered, _FORWARD
    if _registered:
        return
    _ext.load()
    torch.library.register_fake("rlkernel::logp_processed_forward")(_fwd_fake)
    torch.library.register_fake("rlkernel::logp_processed_backward")(_bwd_fake)
    torch.library.register_autograd("rlkernel::logp_processed_forward", _backward, setup_context=_setup_context)
    _FORWARD = torch.ops.rlkernel.logp_processed_forward.default
    _registered = True


def logp_processed_fused(logits: torch.Tensor, token_ids: torch.Tensor, *, temperature, top_k, top_p, min_p,
                         ignore_index: int, return_entropy: bool, requested: str = "auto", report_as=None):
    """Processed log-probs (and the filtered law's entropy) of validated CUDA inputs: (logp, entropy or None),
    float32. Each setting a Python number or a CUDA tensor with one value per row. No host sync: bad ids, and
    per-row settings out of range, give NaN and go to the device error record. ``report_as``: (record address,
    sequence number, error kind) of a calling op whose errors these are (the sampler's), else this call is its own
    ``logp.forward`` call. The dispatch record of the forward is the caller's (rlkernel.logp); the backward's is
    made here, as for plain logp."""
    if not _registered:
        ensure_registered()
    lead = logits.shape[:-1]
    rows, ids = as_rows(logits), flat_ids(token_ids)
    t, t_rows = split_setting(temperature, 1.0, torch.float32)
    k, k_rows = split_setting(top_k, 0, torch.int64)
    p, p_rows = split_setting(top_p, 1.0, torch.float32)
    mp, mp_rows = split_setting(min_p, 0.0, torch.float32)
    report_as, sync = report_as_logp_call(logits, report_as)
    with_grad = torch.compiler.is_compiling() or (torch.is_grad_enabled() and logits.requires_grad)
    with contextlib.nullcontext() if with_grad else _BELOW_AUTOGRAD():
        logp, entropy, _, _ = _FORWARD(rows, ids, float(t), int(k), float(p), float(mp), t_rows, k_rows, p_rows,
                                       mp_rows, ignore_index, return_entropy, *report_as, requested)
    errors.after_call(logits.device, sync)
    return as_lead(logp, lead), (as_lead(entropy, lead) if return_entropy else None)


# register as soon as the extension is loaded (now for an in-tree build, else after the first call loads or builds
# it), so torch.compile and opcheck see the fake kernels; importing never builds
_ext.when_loaded(ensure_registered)
