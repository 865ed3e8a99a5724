"""The registry's two types and its table: ``Shape``, ``Workload``, ``REGISTRY`` and the calls on it.

The family modules (``logp``, ``sampling``, ``linear_logp``, ``grpo_step``) build ``Workload`` values; the
package's ``__init__`` registers them, in one fixed order.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rlkernel import dispatch, errors
from rlkernel.nvtx_ranges import workload_range


@dataclass(frozen=True)
class Shape:
    batch_size: int
    seq_len: int
    vocab_size: int
    top_k: int = 50
    top_p: float = 0.9
    temperature: float = 1.0
    min_p: float = 0.0
    per_row: bool = False  # sampling: the settings as per-row tensors, with per-row seeds (the same values per row)
    hidden_size: int = 1024  # the LM head's input width (linear-logp-* workloads only)

    @property
    def rows(self) -> int:
        return self.batch_size * self.seq_len

    def as_dict(self) -> dict:
        return {"batch_size": self.batch_size, "seq_len": self.seq_len, "vocab_size": self.vocab_size,
                "top_k": self.top_k, "top_p": self.top_p, "temperature": self.temperature, "min_p": self.min_p,
                "per_row": self.per_row, "hidden_size": self.hidden_size}


@dataclass(frozen=True)
class Workload:
    name: str
    op: str  # logp | logp+backward | sample | grpo-step
    path: str  # native | fused
    backend: str  # the backend argument the ops are called with
    fused_ops: tuple[str, ...]
    description: str
    build: Callable[[Shape, torch.dtype, torch.device, int], dict]
    step: Callable[[dict], Any]
    count_bytes: Callable[[Shape, torch.dtype], int]
    count_flops: Callable[[Shape, torch.dtype], int]
    compare: Callable[[dict], str | None] | None = None
    has_backward: bool = False
    uses_seq_len: bool = True
    own_settings: bool = False  # sets its own sampling settings per row: the shape's top_k/top_p/temperature unused
    fused_patterns: tuple[str, ...] = field(default=("rlkernel_*",))
    check_shape: Callable[[Shape], str | None] | None = None  # why a shape cannot run, for CLIs to refuse it early

    def __post_init__(self):
        if self.path not in ("native", "fused"):
            raise ValueError(f"{self.name}: path must be native or fused")
        if (self.path == "fused") != bool(self.fused_ops):
            raise ValueError(f"{self.name}: fused workloads list their fused_ops, native ones none")
        unknown = set(self.fused_ops) - set(dispatch.OPS)
        if unknown:
            raise ValueError(f"{self.name}: unknown ops in fused_ops: {sorted(unknown)}")

    def shape_error(self, shape: Shape) -> str | None:
        """None, or one line saying why this workload cannot run at ``shape`` (checked before any work)."""
        return self.check_shape(self.effective_shape(shape)) if self.check_shape else None

    def effective_shape(self, shape: Shape) -> Shape:
        """Sampling draws one token per row: seq_len is 1 whatever was asked."""
        if self.uses_seq_len:
            return shape
        return dataclasses.replace(shape, seq_len=1)

    def make_inputs(self, shape: Shape, dtype: torch.dtype, device, seed: int) -> dict:
        return self.build(self.effective_shape(shape), dtype, torch.device(device), seed)

    def run(self, inputs: dict):
        """One repetition's work, without the workload range."""
        return self.step(inputs)

    def repetition(self, inputs: dict):
        """One repetition inside its workload range; a backward runs on this thread (contracts, section 3)."""
        single = torch.autograd.set_multithreading_enabled(False) if self.has_backward else contextlib.nullcontext()
        with single, workload_range(self.name):
            return self.step(inputs)

    def check(self, inputs: dict) -> str | None:
        """None, or one line saying how this workload's result differs from the native path on the same inputs.
        Bad input the repetition met on a CUDA device raises here (the device error record, rlkernel.errors)."""
        mismatch = self.compare(inputs) if self.compare else None
        errors.check_errors()  # the comparison has synchronised: reading the record costs one small copy
        return mismatch

    def bytes_moved(self, shape: Shape, dtype: torch.dtype) -> int:
        return int(self.count_bytes(self.effective_shape(shape), dtype))

    def flops(self, shape: Shape, dtype: torch.dtype) -> int:
        return int(self.count_flops(self.effective_shape(shape), dtype))

    def manifest_entry(self, shape: Shape, dtype: torch.dtype, warmup: int, repeat: int) -> dict:
        return {"name": self.name, "op": self.op, "path": self.path, "shape": self.effective_shape(shape).as_dict(),
                "dtype": str(dtype).removeprefix("torch."), "warmup": warmup, "repeat": repeat,
                "bytes": self.bytes_moved(shape, dtype), "flops": self.flops(shape, dtype),
                "fused_patterns": list(self.fused_patterns), "fused_ops": list(self.fused_ops)}


REGISTRY: dict[str, Workload] = {}


def register(workload: Workload) -> Workload:
    if workload.name in REGISTRY:
        raise ValueError(f"workload {workload.name!r} registered twice")
    REGISTRY[workload.name] = workload
    return workload


def names() -> list[str]:
    return list(REGISTRY)


def get(name: str) -> Workload:
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown workload {name!r}; known: {', '.join(REGISTRY)}") from None


def fused_available(workload: Workload, device, dtype: torch.dtype) -> str | None:
    """None when every op of ``workload.fused_ops`` can run fused here, else the first reason it cannot."""
    for op in workload.fused_ops:
        reason = dispatch.fused_unavailable_reason(op, torch.device(device), dtype)
        if reason:
            return reason
    return None
