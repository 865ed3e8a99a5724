"""Per-repetition timing: CUDA events on a GPU, the host clock plus a sync on a CPU.

Every repetition starts with cold caches: on CUDA a buffer twice the L2's size is overwritten before
each repetition, outside the timed region (between the previous end event and the next start event),
so no repetition reads logits a previous one left in L2. Warm-up repetitions run first and are not
kept.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlkernel import errors


@dataclass(frozen=True)
class Stats:
    median_ms: float
    p20_ms: float
    p80_ms: float
    samples: int


def quantile(values: list[float], q: float) -> float:
    """Linear interpolation between the two nearest order statistics (numpy's default method)."""
    if not values:
        raise ValueError("quantile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(times_ms: list[float]) -> Stats:
    return Stats(quantile(times_ms, 0.5), quantile(times_ms, 0.2), quantile(times_ms, 0.8), len(times_ms))


class CacheFlusher:
    """Overwrites a buffer of twice the device's L2 size; a no-op on a CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffer = None
        if device.type == "cuda":
            l2 = torch.cuda.get_device_properties(device).L2_cache_size
            # allocated once, before any row resets the peak-memory counter, so no row is charged for it
            self.buffer = torch.empty(max(2 * int(l2), 1 << 20), dtype=torch.uint8, device=device)

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def __call__(self) -> None:
        if self.buffer is not None:
            self.buffer.fill_(0)  # a write kernel: every L2 line now holds this buffer, not the inputs


def time_repetitions(fn: Callable[[], object], *, device: torch.device, warmup: int, repeat: int,
                     flush: CacheFlusher) -> list[float]:
    """Milliseconds of each of ``repeat`` calls of ``fn`` after ``warmup`` untimed ones."""
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    for _ in range(warmup):
        flush()
        fn()
    if device.type == "cuda":
        return _time_cuda(fn, repeat, flush)
    return _time_host(fn, repeat)


def _time_cuda(fn, repeat: int, flush: CacheFlusher) -> list[float]:
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeat)]
    for start, end in pairs:
        flush()  # queued before the start event: its kernel is not inside [start, end]
        start.record()
        fn()
        end.record()
    # one sync at the end, no host round trip between repetitions; it also reads the device error record, so a
    # repetition that hit bad input raises here (rlkernel.check_errors)
    errors.check_errors()
    return [start.elapsed_time(end) for start, end in pairs]


def _time_host(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out
