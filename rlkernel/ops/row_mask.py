"""``mask=`` of rlkernel.linear_logp and rlkernel.linear_logp_loss: rows to compute (True) and rows to skip (False).

Skipped rows do no GEMM work: the kept rows are compacted (``index_select``) before the op and its results
scattered back (``index_copy`` into zeros) after it, so every GEMM has the kept row count. A GEMM's row count is a
host-side launch parameter, so the count must be known on the host:

- a **CPU mask** (the usual case: padding known when the batch is built) gives it for free: the kept indices are
  computed on the CPU and copied to the device from pinned memory without blocking (no host sync). Not under
  CUDA-graph capture (a captured copy would read a host buffer freed after the call): a ``RuntimeError`` there;
- a **device mask** costs one host sync (``nonzero``: the count), the one exception to the ops' no-sync rule, and
  counted in ``host_syncs``; under CUDA-graph capture (where a sync is impossible) a device mask is applied
  without compaction instead: its rows are treated as ignored (``ignore_index``), full GEMMs, no sync.

Masked rows give logp (and entropy) 0 and no gradient, as ``ignore_index`` rows do.
"""
from __future__ import annotations

import dataclasses
import math

import torch

host_syncs = 0  # device masks compacted so far (each one host sync); tests read it


def check_mask(mask, hidden: torch.Tensor, op: str) -> None:
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(f"{op}: mask must be None or a bool tensor, got {got}")
    if mask.shape != hidden.shape[:-1]:
        raise ValueError(f"{op}: mask shape {tuple(mask.shape)} must equal hidden.shape[:-1] "
                         f"{tuple(hidden.shape[:-1])}")
    if mask.device.type != "cpu" and mask.device != hidden.device:
        raise ValueError(f"{op}: mask on {mask.device} and hidden on {hidden.device}: a mask must be on the CPU "
                         f"or on hidden's device")


def kept_rows(mask: torch.Tensor, device: torch.device):
    """The kept flat row indices (int64, on ``device``), or None where a device mask cannot be compacted (CUDA-graph
    capture): the caller then folds the mask into the ignored rows."""
    global host_syncs
    flat = mask.reshape(-1)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if flat.device.type == "cpu" and capturing:
        raise RuntimeError("mask: a CPU mask cannot be used under CUDA-graph capture (its rows would be copied from "
                           "a host buffer the graph outlives); pass the mask on the device")
    if flat.device.type == "cpu":
        idx = flat.nonzero().squeeze(1)
        if device.type == "cuda":
            idx = idx.pin_memory().to(device, non_blocking=True)
        return idx
    if capturing:
        return None
    host_syncs += 1
    return flat.nonzero().squeeze(1)


def compact(hidden: torch.Tensor, token_ids: torch.Tensor | None, idx: torch.Tensor):
    """The kept rows: hidden ``[k, H]`` (differentiable: skipped rows get gradient 0) and ids ``[k]`` (None: an
    id-less call, entropy alone)."""
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, idx)
    if token_ids is None:
        return rows, None
    return rows, token_ids.reshape(-1).index_select(0, idx.to(token_ids.device))


def compact_options(opts, idx: torch.Tensor):
    """Checked options (``rlkernel.ops.linear_options.Options``, or None) at the kept rows: a per-row temperature
    (a flat ``[N]`` tensor once checked) and its device faults ``[k]``; everything else as given. The options are
    checked on every row before this, so an error names the row of the uncompacted call."""
    if opts is None or not isinstance(opts.temperature, torch.Tensor):
        return opts
    pick = lambda t: t.index_select(0, idx.to(t.device)) if t is not None else None  # noqa: E731
    return dataclasses.replace(opts, temperature=pick(opts.temperature), faults=pick(opts.faults))


def scatter(values, idx: torch.Tensor, lead: torch.Size):
    """``[k]`` per-row results back at their rows of ``lead`` (0 elsewhere); None stays None."""
    if values is None:
        return None
    out = values.new_zeros(math.prod(lead)).index_copy(0, idx, values)
    return out.view(lead)


def as_ignored(token_ids: torch.Tensor, mask: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """The ids with masked rows set to ``ignore_index`` (the uncompacted form of the mask)."""
    return torch.where(mask, token_ids, torch.full((), ignore_index, dtype=token_ids.dtype, device=token_ids.device))
