"""Dispatch records: every op call says which path ran (docs/contracts.md, section 2).

The dispatcher is the only place that decides between the fused CUDA path and the native PyTorch
path; the profile suite, the GRPO example and the capture manifest read these records and never
re-derive them.
"""
from __future__ import annotations

import contextlib
import threading
import warnings
from collections import Counter
from typing import NamedTuple

import torch

import rlkernel
from rlkernel import envflags
from rlkernel.traced import constant_when_traced

OPS = ("logp.forward", "logp.backward", "sample", "linear_logp.forward", "linear_logp.backward",
       "linear_logp_loss")
BACKENDS = ("auto", "fused", "native")
STATUSES = ("native", "fused", "fallback", "blocked")
# rlkernel.integrations: a call sent back to a framework's own code is recorded under the integration's op name
# (``integrations.trl``, ...) with this backend, never as an rlkernel op that did not run.
INTEGRATION_PREFIX = "integrations."
FRAMEWORK = "framework"
_SEVERITY = {"native": 0, "fused": 1, "fallback": 2, "blocked": 3}
FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class FusedKernelUnavailable(RuntimeError):
    """The fused path was demanded (backend="fused", require_fused, RLKERNEL_REQUIRE_FUSED=1) and cannot run."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


FallbackWarning = rlkernel.FallbackWarning  # defined torch-free in rlkernel/__init__.py for `python -W`


class Dispatch(NamedTuple):  # a tuple of strings: torch.compile'd code can build and store one
    op: str
    requested: str
    backend: str
    status: str
    reason: str = ""


_lock = threading.Lock()
_history: Counter = Counter()
_recorders: list[Counter] = []
_warned: set[tuple[str, str]] = set()
# Calls made from torch.compile'd code: the decision is taken when dynamo traces, and each call adds one to its
# record's slot of this CPU tensor, inside the compiled graph (a tensor's values are not guarded, so the count never
# recompiles; a lock, a Counter or a list would break the graph or recompile). history() and recording() fold them in.
_compiled_kinds: list[Dispatch] = []  # slot -> record, made while tracing
_compiled_counts = torch.zeros(256, dtype=torch.int64)
# (op, backend, require_fused, strict, device type, dtype) -> (record, error message or None): a decision depends on
# nothing else (the extension loads once), so each call after the first is a dict lookup.
_decisions: dict[tuple, tuple[Dispatch, str | None]] = {}


def _fold_compiled() -> None:
    """Move the compiled calls' counts into the history and the open recordings (called with _lock held)."""
    if not _compiled_kinds:
        return
    counts = _compiled_counts[:len(_compiled_kinds)].tolist()
    for slot, n in enumerate(counts):
        if n:
            rec = _compiled_kinds[slot]
            _history[rec] += n
            for counter in _recorders:
                counter[rec] += n
    _compiled_counts.zero_()


@constant_when_traced
def _compiled_slot(op: str, requested: str, backend: str, status: str, reason: str) -> int:
    """The counter slot of a record, assigned when torch.compile traces a call that makes it."""
    rec = Dispatch(op, requested, backend, status, reason)
    with _lock:
        if rec not in _compiled_kinds:
            if len(_compiled_kinds) == _compiled_counts.numel():
                raise RuntimeError("rlkernel.dispatch: too many distinct compiled dispatch records")
            _compiled_kinds.append(rec)
        return _compiled_kinds.index(rec)


def _count_compiled(rec: Dispatch) -> None:
    _compiled_counts[_compiled_slot(*rec)] += 1


def record(op: str, requested: str, backend: str, status: str, reason: str = "") -> Dispatch:
    """Store one call's record in the process history and in every open ``recording()`` block."""
    rec = Dispatch(op, requested, backend, status, reason)
    if torch.compiler.is_compiling():
        _count_compiled(rec)
        return rec
    return _count(rec)


def _count(rec: Dispatch) -> Dispatch:
    with _lock:
        _history[rec] += 1
        for counter in _recorders:
            counter[rec] += 1
        first_warning = rec.status == "fallback" and (rec.op, rec.reason) not in _warned
        if first_warning:
            _warned.add((rec.op, rec.reason))
    if first_warning:
        ran = "the framework's own code" if rec.backend == FRAMEWORK else "native"
        warnings.warn(f"rlkernel {rec.op}: fused path unavailable ({rec.reason}); running {ran}", FallbackWarning,
                      stacklevel=4)
    return rec


def framework_fallback(op: str, reason: str, *, backend: str = "auto", require_fused: bool = False) -> Dispatch:
    """An integration (``rlkernel.integrations``) sends one call back to the framework's own code: record it as
    ``Dispatch(op, backend, "framework", "fallback", reason)``, or, when the fused path is demanded
    (``backend="fused"``, ``require_fused``, RLKERNEL_REQUIRE_FUSED=1), as ``blocked`` and raise
    FusedKernelUnavailable. ``op`` names the integration (``integrations.<framework>``), ``reason`` what rlkernel
    cannot compute."""
    if not (isinstance(op, str) and op.startswith(INTEGRATION_PREFIX) and len(op) > len(INTEGRATION_PREFIX)):
        raise ValueError(f"framework_fallback: op must be '{INTEGRATION_PREFIX}<framework>', got {op!r}")
    if not (isinstance(reason, str) and reason):
        raise ValueError("framework_fallback: reason must be a non-empty string")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "fused" or require_fused or strict_from_env():
        _count(Dispatch(op, backend, "none", "blocked", reason))
        raise FusedKernelUnavailable(f"{op}: fused path required but unavailable: {reason}")
    return _count(Dispatch(op, backend, FRAMEWORK, "fallback", reason))


def history() -> list[tuple[Dispatch, int]]:
    with _lock:
        _fold_compiled()
        return list(_history.items())


def history_json() -> list[dict]:
    """The history in the form written into manifests and reports."""
    return [dict(rec._asdict(), count=n) for rec, n in history()]


def reset() -> None:
    with _lock:
        _compiled_counts.zero_()
        _history.clear()
        _warned.clear()


class Recording:
    def __init__(self):
        self._counter: Counter = Counter()

    @property
    def records(self) -> list[tuple[Dispatch, int]]:
        with _lock:
            _fold_compiled()
        return list(self._counter.items())

    def statuses(self, op: str | None = None) -> set[str]:
        return {r.status for r, _ in self.records if op is None or r.op == op}


@contextlib.contextmanager
def recording():
    """Collect the records of one block: ``with recording() as rec: ...; rec.records``."""
    rec = Recording()
    with _lock:
        _fold_compiled()  # earlier compiled calls belong to no block opened now
        _recorders.append(rec._counter)
    try:
        yield rec
    finally:
        with _lock:  # by identity: list.remove would match another block's Counter that compares equal
            _fold_compiled()
            for i, counter in enumerate(_recorders):
                if counter is rec._counter:
                    del _recorders[i]
                    break


def worst(statuses) -> str | None:
    """Where one row or verdict stands for several ops: blocked > fallback > fused > native."""
    statuses = [s for s in statuses if s]
    return max(statuses, key=_SEVERITY.__getitem__) if statuses else None


def strict_from_env() -> bool:
    """RLKERNEL_REQUIRE_FUSED as a boolean (rlkernel.envflags: 1/true/yes/on, 0/false/no/off, unset = False)."""
    if torch.compiler.is_compiling():
        return _strict_for_trace()
    return envflags.env_bool("RLKERNEL_REQUIRE_FUSED")


@constant_when_traced
def _strict_for_trace() -> bool:  # read when torch.compile traces: a compiled graph bakes the decision in
    return envflags.env_bool("RLKERNEL_REQUIRE_FUSED")


def fused_unavailable_reason(op: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the fused path of ``op`` cannot run for tensors on ``device`` of ``dtype``; None when it can. For CUDA
    tensors the first such question loads the extension, building it into the cache first if it is nowhere yet
    (``rlkernel._ext.ensure``): this is the call that needs it."""
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


def _decide(op, backend, require_fused, strict_env, device_type, dtype) -> tuple[Dispatch, str | None]:
    if backend == "native":
        return Dispatch(op, backend, "native", "native"), None
    reason = fused_unavailable_reason(op, torch.device(device_type), dtype)
    if reason is None:
        return Dispatch(op, backend, "fused", "fused"), None
    if backend == "fused" or require_fused or strict_env:
        return (Dispatch(op, backend, "none", "blocked", reason),
                f"{op}: fused path required but unavailable: {reason}")
    return Dispatch(op, backend, "native", "fallback", reason), None


@constant_when_traced
def _decide_for_trace(op, backend, require_fused, strict_env, device_type, dtype) -> tuple:
    """The decision as constants (backend, status, reason, error), taken once when torch.compile traces."""
    rec, error = _decide(op, backend, require_fused, strict_env, device_type, dtype)
    return rec.backend, rec.status, rec.reason, error


def _decision(op: str, backend: str, require_fused: bool, device: torch.device, dtype: torch.dtype) -> tuple:
    """(the Dispatch, the blocked error or None) of a call, decided once per key and cached, not recorded."""
    key = (op, backend, bool(require_fused), strict_from_env(), device.type, dtype)
    decision = _decisions.get(key)
    if decision is None:
        decision = _decisions[key] = _decide(*key)
    return decision


def would_block(op: str, backend: str, require_fused: bool, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``resolve`` would refuse this call (``blocked``), asked without recording it: for a caller that must
    not change its inputs before a call that will be refused (OpenRLHF's in-place temperature division)."""
    return _decision(op, backend, require_fused, device, dtype)[1] is not None


def resolve(op: str, backend: str, require_fused: bool, device: torch.device, dtype: torch.dtype) -> Dispatch:
    """Decide and record the path of one call. Raises FusedKernelUnavailable (recorded `blocked`) before any work.

    In code compiled by torch.compile the decision is the trace's, and the compiled code records it at every call."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "native" and require_fused:
        raise ValueError('backend="native" contradicts require_fused=True')
    if torch.compiler.is_compiling():
        ran, status, reason, error = _decide_for_trace(op, backend, bool(require_fused), strict_from_env(),
                                                       device.type, dtype)
        if error is not None:
            raise FusedKernelUnavailable(error)
        rec = Dispatch(op, backend, ran, status, reason)
        _count_compiled(rec)
        return rec
    rec, error = _decision(op, backend, require_fused, device, dtype)
    _count(rec)
    if error is not None:
        from rlkernel import _ext

        # the typed extension error behind the reason is the cause: a failed build's names its log (the record
        # and this message stay path-free)
        cause = _ext.error()
        raise FusedKernelUnavailable(error) from (cause if cause is not None and cause.reason == rec.reason else None)
    return rec
