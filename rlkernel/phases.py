"""The phases of an RL training job as NVTX ranges (docs/contracts.md, section 3): ``rlkernel.phase(name)``,
``rlkernel.step()``, ``rlkernel.step_begin(i)`` / ``rlkernel.step_end()``.

A phase is one push/pop range in domain ``rlkernel`` named ``phase:<name>`` (nsys shows ``rlkernel:phase:<name>``);
a step is the range ``phase:step`` with the step's index as its int64 payload. With no profiler attached the
``nvtx`` package hands out a dummy domain, and a phase costs one attribute test (``benchmarks/bench_phase.py``
measures it). Torch-free: a launcher or a reward server can mark its phases without importing torch; while
``torch.compile`` traces (torch already imported), no range is opened, so a decorated function does not break
the graph.

``RLKERNEL_CAPTURE_STEPS=A:B`` (set by ``python -m pipelines.capture --steps A:B -- CMD``): the first step whose
index is in [A, B] calls ``cudaProfilerStart`` before its range opens, and the end of the first step whose index
is >= B synchronises the device and calls ``cudaProfilerStop`` after its range closes: nsys's
``--capture-range=cudaProfilerApi`` then records those steps only.
"""
from __future__ import annotations

import functools
import sys
import warnings

from rlkernel import envflags

DOMAIN = "rlkernel"
PREFIX = "phase:"
STEP = "step"
# The names the integrations and the examples use, in the order a GRPO step runs them (contract 3).
STANDARD = ("step", "rollout", "reference_logprob", "old_logprob", "policy_forward", "loss", "backward", "optimizer",
            "weight_sync")

try:
    import nvtx as _nvtx
except ImportError:  # nvtx is a run-time dependency; without it phases are absent, never an error
    _nvtx = None

_domain = _nvtx.get_domain(DOMAIN) if _nvtx is not None else None
# A real domain only when a tool (nsys) is attached; the dummy one records nothing, so skip it altogether.
_enabled = _domain is not None and not isinstance(_domain, _nvtx._lib.DummyDomain)


def _compiling() -> bool:
    torch = sys.modules.get("torch")  # never imported here: a torch-free process cannot be compiling
    return torch is not None and torch.compiler.is_compiling()


class Phase:
    """One phase's range (``rlkernel.phase(name)`` makes or reuses it): a context manager and a decorator. Stateless
    beyond its name and event attributes, so one object serves every thread and every nested entry."""

    __slots__ = ("name", "_attrs")

    def __init__(self, name: str):
        if not isinstance(name, str):
            raise TypeError(f"rlkernel.phase: name must be a str, got {type(name).__name__}")
        if not name:
            raise ValueError("rlkernel.phase: name must not be empty")
        if name == STEP:
            raise ValueError("rlkernel.phase: 'step' is rlkernel.step() (it carries the step index)")
        self.name = name
        self._attrs = _domain.get_event_attributes(message=PREFIX + name) if _enabled else None

    # Entry and exit of one block run in one frame, so both see the same torch.compile state: no range is
    # pushed, and none popped, while dynamo traces (is_compiling() is True for the whole traced frame).
    def __enter__(self):
        if self._attrs is not None and not _compiling():
            _domain.push_range(self._attrs)
        return self

    def __exit__(self, *exc):
        if self._attrs is not None and not _compiling():
            _domain.pop_range()
        return False

    def __call__(self, fn):
        if self._attrs is None:  # no profiler: it cannot attach later (the domain is made once), so no wrapper
            return fn

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)

        return wrapper

    def __repr__(self):
        return f"rlkernel.phase({self.name!r})"


_phases: dict[str, Phase] = {}
_CACHED = 4096  # names kept; past that (names made on the fly, e.g. with an index in them) each call makes one


def phase(name: str) -> Phase:
    """``with rlkernel.phase("rollout"): ...`` or ``@rlkernel.phase("loss")``: one range ``phase:<name>`` in domain
    ``rlkernel`` around the block or each call. Reusable and re-entrant (each entry pushes, each exit pops); the
    object of a name is made once (its name checked, its NVTX string registered) and reused, so a phase named in a
    loop costs a dictionary lookup, not an object."""
    p = _phases.get(name) if isinstance(name, str) else None
    if p is None:
        p = Phase(name)
        if len(_phases) < _CACHED:
            _phases[name] = p
    return p


# ---- steps ---------------------------------------------------------------------------------------------------

class _Steps:
    """The process's training steps: the open one, the next default index and the capture window."""

    def __init__(self):
        self.open: int | None = None
        self.pushed = False
        self.next = 0
        self.window: tuple[int, int] | None = None
        self.window_read = False
        self.capturing = False
        self.captured = False

    def read_window(self) -> tuple[int, int] | None:
        if not self.window_read:  # once, at the first step: a bad value is an EnvFlagError there
            self.window = envflags.capture_steps()
            self.window_read = True
        return self.window


_steps = _Steps()


def _cuda_profiler(start: bool) -> None:
    """cudaProfilerStart / cudaProfilerStop through torch (only reached under RLKERNEL_CAPTURE_STEPS)."""
    import torch

    if not torch.cuda.is_available():
        warnings.warn("rlkernel: RLKERNEL_CAPTURE_STEPS is set but this process has no CUDA device: its steps "
                      "cannot open nsys's capture range", RuntimeWarning, stacklevel=3)
        return
    if start:
        torch.cuda.profiler.start()
    else:
        torch.cuda.synchronize()  # the last step's kernels finish inside the capture range
        torch.cuda.profiler.stop()


def step_begin(index: int | None = None) -> int:
    """Open the range ``phase:step`` for one training step; ``index`` (an int, default: the previous step's + 1,
    from 0) is its payload. Returns the index. RuntimeError when a step is already open."""
    if index is None:
        index = _steps.next
    elif isinstance(index, bool) or not isinstance(index, int):
        raise TypeError(f"rlkernel.step_begin: index must be an int, got {type(index).__name__}")
    elif not -(2 ** 63) <= index < 2 ** 63:
        raise ValueError(f"rlkernel.step_begin: index {index} is outside int64 (the range's payload)")
    if _steps.open is not None:
        raise RuntimeError(f"rlkernel.step_begin({index}): step {_steps.open} is still open; call step_end() first")
    window = _steps.read_window()
    if window is not None:
        first, last = window
        if _steps.capturing and index > last:  # the last step of the window was skipped
            _steps.capturing, _steps.captured = False, True
            _cuda_profiler(False)
        if not _steps.capturing and not _steps.captured and first <= index <= last:
            _steps.capturing = True
            _cuda_profiler(True)
    _steps.pushed = _enabled and not _compiling()
    if _steps.pushed:
        _domain.push_range(_domain.get_event_attributes(message=PREFIX + STEP, payload=index))
    _steps.open, _steps.next = index, index + 1
    return index


def step_end() -> int:
    """Close the open step's range; returns its index. RuntimeError when no step is open."""
    index = _steps.open
    if index is None:
        raise RuntimeError("rlkernel.step_end(): no step is open (call step_begin first)")
    if _steps.pushed:
        _domain.pop_range()
    _steps.open, _steps.pushed = None, False
    if _steps.capturing and index >= _steps.window[1]:
        _steps.capturing, _steps.captured = False, True
        _cuda_profiler(False)
    return index


class step:
    """``with rlkernel.step(): ...`` (or ``rlkernel.step(i)``) around one training step: ``step_begin`` on entry,
    ``step_end`` on exit, also when the block raises. ``as`` gives the index."""

    __slots__ = ("_index",)

    def __init__(self, index: int | None = None):
        self._index = index

    def __enter__(self) -> int:
        return step_begin(self._index)

    def __exit__(self, *exc):
        step_end()
        return False
