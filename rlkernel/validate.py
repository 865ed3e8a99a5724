"""Input checks shared by the ops (docs/contracts.md, section 1: bad input gets a clear error)."""
from __future__ import annotations

import math
import os

import torch


def validation_enabled() -> bool:
    """The post-kernel checks (ids out of range, rows without a distribution) run unless RLKERNEL_VALIDATE=0,
    ``torch.compile`` is tracing (a compiled graph cannot raise; a read-back would break it) or a CUDA graph is
    being captured."""
    if os.environ.get("RLKERNEL_VALIDATE", "1") == "0" or torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _position(flat: int, shape) -> tuple[int, ...]:
    pos = []
    for size in reversed(tuple(shape)):
        pos.append(flat % size if size else 0)
        flat //= max(size, 1)
    return tuple(reversed(pos))


def bad_id_error(flat_pos: int, ids_shape, value: int | None = None, vocab_size: int | None = None) -> IndexError:
    """The IndexError for a token id outside [0, V) that is not ignore_index, naming the first bad position."""
    pos = _position(int(flat_pos), ids_shape)
    what = f" (id {value}, vocab size {vocab_size})" if value is not None else ""
    return IndexError(f"token id out of range at position {pos}{what}")


def check_logits(logits) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor, got {logits.dtype}")
    if logits.dim() < 1:
        raise ValueError("logits must have at least one dimension (the vocabulary)")


def check_logp_args(logits, token_ids, temperature) -> None:
    check_logits(logits)
    if not isinstance(token_ids, torch.Tensor):
        raise TypeError(f"token_ids must be a torch.Tensor, got {type(token_ids).__name__}")
    if token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool or token_ids.is_complex():
        raise TypeError(f"token_ids must be an integer tensor, got {token_ids.dtype}")
    if tuple(token_ids.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"token_ids shape {tuple(token_ids.shape)} must equal logits.shape[:-1] {tuple(logits.shape[:-1])}"
            f" (logits shape {tuple(logits.shape)})"
        )
    if logits.device != token_ids.device:
        raise ValueError(f"logits on {logits.device} and token_ids on {token_ids.device}: must be on one device")
    if not (0.0 < float(temperature) < math.inf):  # also rejects NaN
        raise ValueError(f"temperature must be a finite number > 0 for logp, got {temperature}")


def check_sample_args(logits, temperature, top_k, top_p, generator) -> None:
    check_logits(logits)
    if not (0.0 <= float(temperature) < math.inf):
        raise ValueError(f"temperature must be a finite number >= 0 for sample, got {temperature}")
    if int(top_k) != top_k or top_k < 0:
        raise ValueError(f"top_k must be a non-negative integer, got {top_k}")
    if not (0.0 < float(top_p) <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if logits.shape[-1] == 0 and logits.shape[:-1].numel() > 0:
        raise ValueError("sample: a vocabulary of size 0 has no distribution")
    if generator is not None and generator.device.type != logits.device.type:
        raise ValueError(f"generator on {generator.device} but logits on {logits.device}")
