"""Dispatch records: every op call says which path ran (docs/contracts.md, section 2).

The dispatcher is the only place that decides between the fused CUDA path and the native PyTorch
path; the profile suite, the GRPO example and the capture manifest read these records and never
re-derive them.
"""
from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections import Counter
from dataclasses import asdict, dataclass

import torch

OPS = ("logp.forward", "logp.backward", "sample")
BACKENDS = ("auto", "fused", "native")
STATUSES = ("native", "fused", "fallback", "blocked")
_SEVERITY = {"native": 0, "fused": 1, "fallback": 2, "blocked": 3}
FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class FusedKernelUnavailable(RuntimeError):
    """The fused path was demanded (backend="fused", require_fused, RLKERNEL_REQUIRE_FUSED=1) and cannot run."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class FallbackWarning(UserWarning):
    """backend="auto" wanted the fused path and ran native instead (said once per op and reason)."""


@dataclass(frozen=True)
class Dispatch:
    op: str
    requested: str
    backend: str
    status: str
    reason: str = ""


_lock = threading.Lock()
_history: Counter = Counter()
_recorders: list[Counter] = []
_warned: set[tuple[str, str]] = set()


def record(op: str, requested: str, backend: str, status: str, reason: str = "") -> Dispatch:
    """Store one call's record in the process history and in every open ``recording()`` block."""
    rec = Dispatch(op, requested, backend, status, reason)
    with _lock:
        _history[rec] += 1
        for counter in _recorders:
            counter[rec] += 1
        first_warning = status == "fallback" and (op, reason) not in _warned
        if first_warning:
            _warned.add((op, reason))
    if first_warning:
        warnings.warn(f"rlkernel {op}: fused path unavailable ({reason}); running native", FallbackWarning,
                      stacklevel=4)
    return rec


def history() -> list[tuple[Dispatch, int]]:
    with _lock:
        return list(_history.items())


def history_json() -> list[dict]:
    """The history in the form written into manifests and reports."""
    return [dict(asdict(rec), count=n) for rec, n in history()]


def reset() -> None:
    with _lock:
        _history.clear()
        _warned.clear()


class Recording:
    def __init__(self):
        self._counter: Counter = Counter()

    @property
    def records(self) -> list[tuple[Dispatch, int]]:
        return list(self._counter.items())

    def statuses(self, op: str | None = None) -> set[str]:
        return {r.status for r in self._counter if op is None or r.op == op}


@contextlib.contextmanager
def recording():
    """Collect the records of one block: ``with recording() as rec: ...; rec.records``."""
    rec = Recording()
    with _lock:
        _recorders.append(rec._counter)
    try:
        yield rec
    finally:
        with _lock:  # by identity: list.remove would match another block's Counter that compares equal
            for i, counter in enumerate(_recorders):
                if counter is rec._counter:
                    del _recorders[i]
                    break


def worst(statuses) -> str | None:
    """Where one row or verdict stands for several ops: blocked > fallback > fused > native."""
    statuses = [s for s in statuses if s]
    return max(statuses, key=_SEVERITY.__getitem__) if statuses else None


def strict_from_env() -> bool:
    return os.environ.get("RLKERNEL_REQUIRE_FUSED", "") not in ("", "0")


def fused_unavailable_reason(op: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the fused path of ``op`` cannot run for tensors on ``device`` of ``dtype``; None when it can."""
    from rlkernel import _ext

    if device.type != "cuda":
        return f"tensor on {device.type}"
    if dtype not in FUSED_DTYPES:
        return f"dtype {str(dtype).removeprefix('torch.')} unsupported"
    reason = _ext.unavailable_reason()
    if reason:
        return reason
    if not _ext.has_op(op.split(".")[0]):
        return f"extension built without the {op.split('.')[0]} kernels"
    return None


def resolve(op: str, backend: str, require_fused: bool, device: torch.device, dtype: torch.dtype) -> Dispatch:
    """Decide and record the path of one call. Raises FusedKernelUnavailable (recorded `blocked`) before any work."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "native":
        if require_fused:
            raise ValueError('backend="native" contradicts require_fused=True')
        return record(op, backend, "native", "native")
    strict = backend == "fused" or require_fused or strict_from_env()
    reason = fused_unavailable_reason(op, device, dtype)
    if reason is None:
        return record(op, backend, "fused", "fused")
    if strict:
        record(op, backend, "none", "blocked", reason)
        raise FusedKernelUnavailable(f"{op}: fused path required but unavailable: {reason}")
    return record(op, backend, "native", "fallback", reason)
