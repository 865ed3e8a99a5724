"""How the fused backends hand tensors to the kernels: rows, flat ids, per-row settings, row gradients, the eager
entry's condition and the error-record slot of a log-prob call. One copy each, shared by fused/logp, fused/
logp_processed, fused/sampling, fused/linear_logp and linear_logp_loss_chunks (they used to import each other for
these, which made a circle).

Every function here is cheap host code on the hot path: no device work beyond the copies it names, no host sync.
"""
from __future__ import annotations

import math

import torch

from rlkernel import errors

_dispatch_modes = torch._C._len_torch_dispatch_stack  # modes a direct call would skip


def as_rows(logits: torch.Tensor) -> torch.Tensor:
    """``[..., V]`` as ``[N, V]`` with a contiguous last dim: a view when the leading dims collapse, else a copy."""
    if logits.dim() == 2 and (logits.stride(1) == 1 or logits.shape[1] <= 1):
        return logits  # already rows: the common case costs no reshape
    n, v = math.prod(logits.shape[:-1]), logits.shape[-1]
    rows = logits.reshape(n, v)
    if v > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    return rows


def as_lead(t: torch.Tensor | None, lead: torch.Size) -> torch.Tensor | None:
    """A per-row result ``[N]`` shaped as the caller's leading dims ``lead``; None stays None. With one leading dim
    (``[N, V]`` logits, the common case) it already is: no view, whose host time (~1-3 us a tensor) a decode step
    pays per output (``benchmarks/bench_overhead.py``, B = 1)."""
    return t if t is None or len(lead) == 1 else t.view(lead)


def flat_ids(token_ids: torch.Tensor) -> torch.Tensor:
    """The token ids as the kernels read them: int64 [N], contiguous (a view when they already are)."""
    ids = token_ids.reshape(-1)
    if ids.dtype != torch.int64:
        ids = ids.to(torch.int64)
    return ids if ids.is_contiguous() else ids.contiguous()


def row_grad(g):
    """A row gradient as float32 [N] with one stride (a view when possible; autograd often hands in expanded ones)."""
    if g is None:
        return None
    return g.reshape(-1).to(torch.float32)


def split_setting(value, default, dtype):
    """(scalar for the op, per-row tensor or None) of one setting: a tensor goes per row ([N], contiguous, dtype)
    and its scalar slot gets the (valid) default; a number goes as the scalar."""
    if isinstance(value, torch.Tensor):
        rows = value.reshape(-1)
        if rows.dtype != dtype:
            rows = rows.to(dtype)
        return default, rows.contiguous()
    return value, None


def int64_arg(value: int) -> int:
    """A Python int as the int64 the op carries (seeds are 64 random bits: 2^63 .. 2^64 - 1 wrap to negatives)."""
    value = int(value) & 0xFFFFFFFFFFFFFFFF
    return value - (1 << 64) if value >= 1 << 63 else value


def report_as_logp_call(logits: torch.Tensor, report_as):
    """(where the kernels report bad values, raise after the call): a calling op's ``report_as`` as given (its
    errors, its sequence number), else this call's own ``logp.forward`` entry in the device error record."""
    if report_as is not None:
        return report_as, False
    address, seq, sync = errors.begin("logp.forward", logits.device, logits.shape[:-1], logits.shape[-1])
    return (address, seq, errors.ERR_LOGP_BAD_ID), sync


def eager_entry_ok(*tensors) -> bool:
    """Whether an op may enter the extension directly (csrc/python_module.cpp), i.e. torch's dispatcher would add
    nothing: no torch.compile trace, no tensor subclass or dispatch mode (fake tensors, FlopCounter, ...) that must
    see the op. ``tensors``: the op's tensor arguments (None for an absent optional one). The caller rules out a
    gradient to record."""
    if torch.compiler.is_compiling() or _dispatch_modes():
        return False
    return all(t is None or type(t) is torch.Tensor for t in tensors)
