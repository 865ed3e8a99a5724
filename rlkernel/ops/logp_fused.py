"""The fused CUDA backend of rlkernel.logp: fake kernels, autograd, and the call the dispatcher makes.

The ops (registered in csrc/bindings.cpp, kernels in csrc/include/rlkernel/logp_kernels.cuh):

- ``torch.ops.rlkernel.logp_forward(logits[N, V], ids[N] int64, temperature, ignore_index, compute_entropy,
  inplace_backward=False, requested="fused") -> (logp[N] f32, entropy[N] f32 (or [0] without entropy),
  stats[N, 2] f32, bad_pos[1] int64)``. ``stats`` = (r, log2 s) per row in base-2 units of x / T
  (lse = ln2 * (r + log2 s)); ``bad_pos`` = first row whose id is outside [0, V) (not ignore_index), else
  ``NO_BAD_POSITION``. ``inplace_backward`` and ``requested`` are read by the autograd formula only.
- ``logp_backward(grad_logp?, grad_entropy?, logits, ids, stats, entropy, temperature, ignore_index) -> grad``
- ``logp_backward_inplace(...)``: the same, writing the gradient into ``logits`` (**the logits are overwritten**).

Registration here happens once, after the extension loaded (the schemas live in C++).
"""
from __future__ import annotations

import math

import torch

from rlkernel import _ext, dispatch
from rlkernel.validate import bad_id_error, validation_enabled

NO_BAD_POSITION = 0x7F7F7F7F7F7F7F7F  # the bytes of the launcher's 0x7F memset (csrc/include/rlkernel/logp_api.h)

_registered = False


def _fwd_fake(logits, token_ids, temperature, ignore_index, compute_entropy, inplace_backward=False,
              requested="fused"):
    n = logits.shape[0]
    f32 = dict(dtype=torch.float32, device=logits.device)
    return (torch.empty((n,), **f32), torch.empty((n if compute_entropy else 0,), **f32),
            torch.empty((n, 2), **f32), torch.empty((1,), dtype=torch.int64, device=logits.device))


def _bwd_fake(grad_logp, grad_entropy, logits, token_ids, stats, entropy, temperature, ignore_index):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _bwd_inplace_fake(grad_logp, grad_entropy, logits, token_ids, stats, entropy, temperature, ignore_index):
    return None


def _setup_context(ctx, inputs, output):
    logits, ids, temperature, ignore_index, compute_entropy, inplace_backward, requested = inputs
    _, entropy, stats, bad_pos = output
    ctx.mark_non_differentiable(stats, bad_pos)
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no entropy term in the kernel
    ctx.save_for_backward(logits, ids, stats, entropy)
    ctx.temperature, ctx.ignore_index = temperature, ignore_index
    ctx.compute_entropy, ctx.inplace, ctx.requested = compute_entropy, inplace_backward, requested


def _row_grad(g):
    """A row gradient as float32 [N] with one stride (a view when possible; autograd often hands in expanded ones)."""
    if g is None:
        return None
    return g.reshape(-1).to(torch.float32)


def _backward(ctx, grad_logp, grad_entropy, grad_stats, grad_bad):
    logits, ids, stats, entropy = ctx.saved_tensors
    if not ctx.compute_entropy or (grad_entropy is not None and grad_entropy.numel() == 0):
        grad_entropy = None
    if grad_logp is None and grad_entropy is None:
        return (None,) * 7
    dispatch.record("logp.backward", ctx.requested, "fused", "fused")
    args = (_row_grad(grad_logp), _row_grad(grad_entropy), logits, ids, stats, entropy, ctx.temperature,
            ctx.ignore_index)
    if ctx.inplace:
        torch.ops.rlkernel.logp_backward_inplace(*args)
        grad = logits
    else:
        grad = torch.ops.rlkernel.logp_backward(*args)
    return grad, None, None, None, None, None, None


def ensure_registered() -> None:
    """Load rlkernel._C (raises rlkernel._ext.ExtensionNotBuilt) and register fakes and autograd once."""
    global _registered
    if _registered:
        return
    _ext.load()
    torch.library.register_fake("rlkernel::logp_forward")(_fwd_fake)
    torch.library.register_fake("rlkernel::logp_backward")(_bwd_fake)
    torch.library.register_fake("rlkernel::logp_backward_inplace")(_bwd_inplace_fake)
    torch.library.register_autograd("rlkernel::logp_forward", _backward, setup_context=_setup_context)
    _registered = True


def as_rows(logits: torch.Tensor) -> torch.Tensor:
    """``[..., V]`` as ``[N, V]`` with a contiguous last dim: a view when the leading dims collapse, else a copy."""
    n, v = math.prod(logits.shape[:-1]), logits.shape[-1]
    rows = logits.reshape(n, v)
    if v > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    return rows


def logp_fused(logits: torch.Tensor, token_ids: torch.Tensor, *, temperature: float, ignore_index: int,
               return_entropy: bool, inplace_backward: bool, requested: str = "auto"):
    """Fused log-probs (and entropy) of validated CUDA inputs; returns (logp, entropy or None), float32.

    ``inplace_backward=True``: the backward writes the gradient into the logits' storage (when ``as_rows`` could
    view them; a non-collapsible input is copied first and the copy is overwritten instead). ``requested`` is the
    backend the caller asked for; the backward's dispatch record repeats it.
    """
    if not _registered:
        ensure_registered()
    lead = logits.shape[:-1]
    rows = as_rows(logits)
    ids = token_ids.reshape(-1)
    if ids.dtype != torch.int64:
        ids = ids.to(torch.int64)
    ids = ids.contiguous()
    logp, entropy, _, bad_pos = torch.ops.rlkernel.logp_forward(
        rows, ids, float(temperature), int(ignore_index), bool(return_entropy), bool(inplace_backward), requested)
    # One small copy, after the kernel: skipped while torch.compile traces (no data-dependent raise in a graph),
    # inside CUDA-graph capture and with RLKERNEL_VALIDATE=0 (the bad rows are NaN either way).
    if rows.shape[0] and validation_enabled():
        first = int(bad_pos.item())
        if first != NO_BAD_POSITION:
            raise bad_id_error(first, lead, int(ids[first]), logits.shape[-1])
    return logp.view(lead), (entropy.view(lead) if return_entropy else None)


try:  # register as soon as the extension is there, so torch.compile and opcheck see the fake kernels
    ensure_registered()
except _ext.ExtensionNotBuilt:
    pass
