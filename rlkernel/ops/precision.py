"""Mixed precision for rlkernel.linear_logp and rlkernel.linear_logp_loss: the compute dtype of the GEMMs, separate
from the dtypes the inputs are stored in, and the dtype the weight / bias gradients accumulate in.

- **Compute dtype** (``compute_dtype``): under ``torch.autocast`` for the inputs' device (and no float64 input, which
  autocast leaves alone) the autocast dtype; outside it one dtype chosen from hidden, weight and bias: their dtype
  when they share it, else the lowest-precision one (bf16 hidden + float32 weight -> bf16; float32 + float64 ->
  float32); bfloat16 mixed with float16 has no such dtype and is a ``TypeError``. The GEMM operands of the forward
  and of the backward are the inputs cast to it (a copy where the dtype differs), on both backends, with autocast
  switched off inside the op (``no_autocast``) so neither pass sees a second cast.
- **Gradients** come back in each input's own dtype (hidden's in hidden's, the weight's in the weight's).
- **Accumulation** (``accumulation_dtype``) of dW / db over row blocks or chunks: ``grad_accumulation="float32"``
  (the default, as TRL's ``ChunkedLogProbFunction`` does: its ``grad_w`` / ``grad_b`` are float32 buffers), a float32
  ``[V, H]`` buffer (V H 4 bytes: 2 GiB at V = 128256, H = 4096, plus the returned gradient in the weight's dtype
  when that is 16-bit) where there is more than one row block / chunk to sum over (one: the GEMM's own float32
  accumulator is rounded once either way, and no buffer is needed); ``"input"``: in the weight's own dtype (what
  the ops did before the option existed; a bf16 weight's dW rounded at every block / chunk). float32 and float64
  weights accumulate in float32 (float64 for float64 compute) either way.
"""
from __future__ import annotations

import contextlib

import torch

from rlkernel.ops.blas import SIXTEEN_BIT

GRAD_ACCUMULATIONS = ("float32", "input")
_RANK = {torch.float64: 2, torch.float32: 1, torch.bfloat16: 0, torch.float16: 0}
_AUTOCAST_DEVICES = ("cuda", "cpu")


def check_grad_accumulation(value) -> str:
    if not isinstance(value, str) or value not in GRAD_ACCUMULATIONS:
        raise ValueError(f"grad_accumulation must be one of {', '.join(map(repr, GRAD_ACCUMULATIONS))}, got {value!r}")
    return value


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    if device.type in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.dtype:
    """The GEMMs' dtype for these inputs (module docstring). Dtypes outside _RANK are refused by the caller's
    checks before this runs."""
    dtypes = [t.dtype for t in (hidden, weight, bias) if t is not None]
    auto = _autocast_dtype(hidden.device)
    if auto is not None and torch.float64 not in dtypes:
        return auto
    if len(set(dtypes)) == 1:
        return dtypes[0]
    if torch.bfloat16 in dtypes and torch.float16 in dtypes:
        names = ", ".join(f"{n} {str(t.dtype).removeprefix('torch.')}"
                          for n, t in (("hidden", hidden), ("weight", weight), ("bias", bias)) if t is not None)
        raise TypeError(f"mixed bfloat16 and float16 inputs ({names}) have no common compute dtype: cast one of them "
                        f"(or run under torch.autocast)")
    return min(dtypes, key=lambda d: _RANK.get(d, 1))


def accumulation_dtype(weight_dtype: torch.dtype, compute: torch.dtype, mode: str, parts: int = 2) -> torch.dtype:
    """The dtype dW / db are summed in over ``parts`` row blocks or chunks: float64 for float64 compute; the
    weight's 16-bit dtype for "input" when the GEMMs compute in it, or for one part (one GEMM per vocabulary chunk,
    its own float32 accumulator rounded once either way: no float32 buffer); else float32 (a GEMM cannot write one
    16-bit dtype from operands of the other)."""
    if compute == torch.float64:
        return torch.float64
    if weight_dtype in SIXTEEN_BIT and weight_dtype == compute and (mode == "input" or parts <= 1):
        return weight_dtype
    return torch.float32


def cast(t, dtype: torch.dtype, contiguous: bool = False):
    """t in ``dtype`` (itself when it already is; ``contiguous``: and contiguous); None stays None."""
    if t is None:
        return None
    if t.dtype != dtype:
        return t.to(dtype, memory_format=torch.contiguous_format) if contiguous else t.to(dtype)
    return t.contiguous() if contiguous and not t.is_contiguous() else t


def no_autocast(device: torch.device):
    """Autocast off for the op's own code (its casts are explicit): a no-op where autocast is not on."""
    if device.type in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def sixteen_bit(dtype: torch.dtype) -> bool:
    return dtype in SIXTEEN_BIT


def autocast_state(device: torch.device):
    """(device type, dtype) of the caller's autocast on ``device``, or None: what user code run inside the op (the
    loss's ``loss_fn``) is run under again."""
    dtype = _autocast_dtype(device)
    return None if dtype is None else (device.type, dtype)


def caller_autocast(state):
    """Re-enter the caller's autocast (``autocast_state``) for user code inside the op."""
    return contextlib.nullcontext() if state is None else torch.autocast(state[0], dtype=state[1])
