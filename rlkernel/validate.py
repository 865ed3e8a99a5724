"""Argument checks shared by the ops (docs/contracts.md, section 1: bad input gets a clear error before any work).

They read Python values and tensor metadata only, never a CUDA tensor's values (no host sync). On CPU the token
ids are checked here too, so a rejected call leaves no dispatch record. Bad values on CUDA go to the device error
record instead (``rlkernel.errors``).
"""
from __future__ import annotations

import math
import numbers

import torch

_INT64 = (-(1 << 63), (1 << 63) - 1)
_LOG2E = 1.4426950408889634  # the fused kernels scale by log2(e) / T: it must stay finite too
_F32_MAX = torch.finfo(torch.float32).max


def position_in(flat: int, shape) -> tuple[int, ...]:
    """The index tuple of flat position ``flat`` in a tensor of ``shape`` (row-major)."""
    pos = []
    for size in reversed(tuple(shape)):
        pos.append(flat % size if size else 0)
        flat //= max(size, 1)
    return tuple(reversed(pos))


def bad_id_error(where, value: int, vocab_size: int | None, op: str = "logp.forward", note: str = "") -> IndexError:
    """The IndexError for a token id outside [0, V) that is not ignore_index: the op, the first bad position (an
    index tuple, or a flat position), the id and V. The CPU check and the device error record both raise it."""
    size = f", vocab size {vocab_size}" if vocab_size is not None else ""
    return IndexError(f"{op}: token id out of range at position {where} (id {value}{size}){note}")


def no_distribution_error(row: int, note: str = "") -> ValueError:
    """The ValueError for a row ``sample`` cannot draw from (a NaN, or no finite logit), counted flat."""
    return ValueError(f"sample: row {row} has no finite probabilities (all -inf or NaN logits){note}")


def check_logits(logits) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor, got {logits.dtype}")
    if logits.dim() < 1:
        raise ValueError("logits must have at least one dimension (the vocabulary)")
    if logits.is_meta:
        raise ValueError("logits are on the meta device, which holds no values: use a CPU or CUDA tensor")


def _real(name: str, value) -> float:
    if type(value) is float:  # the common case first: an ABC isinstance costs a loop's microseconds
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def _int64(name: str, value) -> int:
    if type(value) is int and _INT64[0] <= value <= _INT64[1]:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    if not _INT64[0] <= value <= _INT64[1]:
        raise ValueError(f"{name} must fit in int64, got {value}")
    return int(value)


def check_temperature(temperature, allow_zero: bool) -> float:
    """A finite T > 0 (>= 0 for sample) whose scale log2(e) / T is a finite float32, the type the fused kernels scale
    in and logp returns: 1e-45 would turn finite logits into -inf/NaN."""
    t = _real("temperature", temperature)
    low_ok = t >= 0.0 if allow_zero else t > 0.0
    if not (low_ok and t < math.inf):  # also rejects NaN
        bound = ">= 0 for sample" if allow_zero else "> 0 for logp"
        raise ValueError(f"temperature must be a finite number {bound}, got {temperature}")
    if t > 0.0 and _LOG2E / t > _F32_MAX:
        raise ValueError(f"temperature {temperature} is too small: 1/temperature overflows float32")
    return t


def check_logp_args(logits, token_ids, temperature, ignore_index) -> None:
    check_logits(logits)
    if not isinstance(token_ids, torch.Tensor):
        raise TypeError(f"token_ids must be a torch.Tensor, got {type(token_ids).__name__}")
    if token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool or token_ids.is_complex():
        raise TypeError(f"token_ids must be an integer tensor, got {token_ids.dtype}")
    if token_ids.shape != logits.shape[:-1]:
        raise ValueError(
            f"token_ids shape {tuple(token_ids.shape)} must equal logits.shape[:-1] {tuple(logits.shape[:-1])}"
            f" (logits shape {tuple(logits.shape)})"
        )
    if logits.device != token_ids.device:
        raise ValueError(f"logits on {logits.device} and token_ids on {token_ids.device}: must be on one device")
    check_temperature(temperature, allow_zero=False)
    ignore_index = _int64("ignore_index", ignore_index)
    # A CPU check costs no sync: raise before any work, as the contract says. Not while torch.compile traces: a
    # compiled graph cannot raise on values (the bad rows are NaN).
    if logits.device.type == "cpu" and not torch.compiler.is_compiling():
        ids = token_ids.reshape(-1).long()
        bad = (ids != ignore_index) & ((ids < 0) | (ids >= logits.shape[-1]))
        if bool(bad.any()):
            first = int(bad.nonzero()[0])
            raise bad_id_error(position_in(first, token_ids.shape), int(ids[first]), logits.shape[-1])


def check_sample_args(logits, temperature, top_k, top_p, generator) -> None:
    check_logits(logits)
    check_temperature(temperature, allow_zero=True)
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Real) or not math.isfinite(top_k) \
            or int(top_k) != top_k or top_k < 0:
        raise ValueError(f"top_k must be a non-negative integer, got {top_k!r}")
    if not (0.0 < _real("top_p", top_p) <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if logits.shape[-1] == 0 and logits.shape[:-1].numel() > 0:
        raise ValueError("sample: a vocabulary of size 0 has no distribution")
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        if generator.device.type != logits.device.type:
            raise ValueError(f"generator on {generator.device} but logits on {logits.device}")
