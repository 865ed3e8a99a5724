"""rlkernel.linear_logp: per-token log-probs (and entropy) straight from hidden states and the LM head's weight.

``log_softmax((hidden @ weight.T + bias) / temperature)`` at the ids, without ever holding the N x V logits: the
native backend (``linear_logp_native``) works in token chunks, the fused one (``linear_logp_fused``) in tiles of a
bounded workspace. Conventions are those of ``rlkernel.logp`` (docs/contracts.md, section 1).
"""
from __future__ import annotations

import torch

from rlkernel import dispatch
from rlkernel.validate import _int64, bad_id_error, check_temperature, position_in

OP = "linear_logp.forward"


def _tensor(name: str, value, *, floating: bool) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if floating and not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {value.dtype}")
    if value.is_meta:
        raise ValueError(f"{name} is on the meta device, which holds no values: use a CPU or CUDA tensor")
    return value


def check_linear_logp_args(hidden, weight, token_ids, bias, temperature, ignore_index) -> None:
    """Types, shapes, dtypes, devices and scalars, before any work (tensor metadata only: no host sync on CUDA).
    On CPU the ids are checked here too, so a rejected call leaves no dispatch record."""
    _tensor("hidden", hidden, floating=True)
    _tensor("weight", weight, floating=True)
    if hidden.dim() < 1:
        raise ValueError("hidden must have at least one dimension (the hidden size): [..., H]")
    if weight.dim() != 2:
        raise ValueError(f"weight must be [V, H] (the LM head's layout), got shape {tuple(weight.shape)}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight shape {tuple(weight.shape)} must be [V, H] with H = hidden.shape[-1] = "
                         f"{hidden.shape[-1]}")
    if weight.shape[0] == 0:
        raise ValueError("weight has no rows: a vocabulary of size 0 has no distribution")
    if weight.shape[0] >= 1 << 31:
        raise ValueError(f"weight has {weight.shape[0]} rows: the vocabulary must be < 2^31")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight dtype {weight.dtype} must equal hidden dtype {hidden.dtype}")
    if weight.device != hidden.device:
        raise ValueError(f"hidden on {hidden.device} and weight on {weight.device}: must be on one device")
    if bias is not None:
        _tensor("bias", bias, floating=True)
        if bias.shape != weight.shape[:1]:
            raise ValueError(f"bias shape {tuple(bias.shape)} must be [V] = ({weight.shape[0]},)")
        if bias.dtype != hidden.dtype:
            raise TypeError(f"bias dtype {bias.dtype} must equal hidden dtype {hidden.dtype}")
        if bias.device != hidden.device:
            raise ValueError(f"hidden on {hidden.device} and bias on {bias.device}: must be on one device")
    _tensor("token_ids", token_ids, floating=False)
    if token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool or token_ids.is_complex():
        raise TypeError(f"token_ids must be an integer tensor, got {token_ids.dtype}")
    if token_ids.shape != hidden.shape[:-1]:
        raise ValueError(f"token_ids shape {tuple(token_ids.shape)} must equal hidden.shape[:-1] "
                         f"{tuple(hidden.shape[:-1])} (hidden shape {tuple(hidden.shape)})")
    if token_ids.device != hidden.device:
        raise ValueError(f"hidden on {hidden.device} and token_ids on {token_ids.device}: must be on one device")
    check_temperature(temperature, allow_zero=False)
    ignore_index = _int64("ignore_index", ignore_index)
    if hidden.device.type == "cpu":  # no sync on CPU: raise at once, as rlkernel.logp does
        ids = token_ids.reshape(-1).long()
        vocab = weight.shape[0]
        bad = (ids != ignore_index) & ((ids < 0) | (ids >= vocab))
        if bool(bad.any()):
            first = int(bad.nonzero()[0])
            raise bad_id_error(position_in(first, token_ids.shape), int(ids[first]), vocab, OP)


def linear_logp(hidden: torch.Tensor, weight: torch.Tensor, token_ids: torch.Tensor, *, bias=None,
                temperature: float = 1.0, ignore_index: int = -100, return_entropy: bool = False,
                batch_invariant: bool = False, backend: str = "auto", require_fused: bool = False):
    """``log_softmax((hidden @ weight.T + bias) / temperature)`` at ``token_ids``: float32, shape
    ``hidden.shape[:-1]``; with ``return_entropy=True`` a tuple ``(logp, entropy)``. Gradients flow to hidden,
    weight and bias.

    ``hidden [..., H]``, ``weight [V, H]`` (the LM head's layout), ``bias [V]`` or None, all of one dtype and
    device. The logits are the matmul's result in that dtype (as ``hidden @ weight.T`` gives them), upcast to
    float32 for the softmax. Rows whose id is ``ignore_index`` give 0 and no gradient. ``batch_invariant=True``:
    a row's results (logp, entropy, its hidden gradient) are bitwise the same whatever the number of rows and
    wherever the row sits (fixed tile shapes and reduction order; slower for few rows). ``backend``: "auto",
    "fused" or "native", as for ``rlkernel.logp``. On CUDA nothing waits for the GPU: an id outside [0, V) gives
    NaN (and NaN gradients) and goes to the device error record (``rlkernel.check_errors``); on CPU it raises
    ``IndexError`` at once. See docs/contracts.md.
    """
    check_linear_logp_args(hidden, weight, token_ids, bias, temperature, ignore_index)
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"batch_invariant must be a bool, got {type(batch_invariant).__name__}")
    rec = dispatch.resolve(OP, backend, require_fused, hidden.device, hidden.dtype)
    kwargs = dict(bias=bias, temperature=float(temperature), ignore_index=int(ignore_index),
                  return_entropy=bool(return_entropy), batch_invariant=batch_invariant, requested=backend)
    if rec.status == "fused":
        from rlkernel.ops.linear_logp_fused import linear_logp_fused

        out, ent = linear_logp_fused(hidden, weight, token_ids, **kwargs)
    else:
        from rlkernel.ops.linear_logp_native import linear_logp_native

        out, ent = linear_logp_native(hidden, weight, token_ids, fallback_reason=rec.reason, **kwargs)
    return (out, ent) if return_entropy else out
