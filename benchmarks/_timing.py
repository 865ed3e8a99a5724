"""CUDA-event timing and peak-memory helpers of bench_logp.py, bench_linear_logp.py and bench_linear_logp_loss.py, and
the NxHxV shape parser of the two linear-logp benches (a module, not a script). The timers need a CUDA device;
importing this needs only torch and rlkernel.cli."""
from __future__ import annotations

import statistics

import torch

from rlkernel.cli import CliError


def events_median(fn, prep, warmup: int, repeat: int) -> float:
    """Median milliseconds of ``fn()`` over ``repeat`` runs after ``warmup``, each run timed by its own pair of CUDA
    events; ``prep()`` (e.g. resetting gradients) runs before each run, outside the events. One sync at the end."""
    for _ in range(warmup):
        prep()
        fn()
    pairs = []
    for _ in range(repeat):
        prep()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs)


def peak_extra(fn, prep) -> int:
    """Bytes: the allocator's peak during one ``fn()`` (after ``prep()``) minus what was allocated before it."""
    prep()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


def parse_nhv(text: str) -> tuple[int, int, int]:
    """``--shapes`` NxHxV (tokens x hidden x vocabulary) as three positive ints; CliError otherwise."""
    try:
        n, h, v = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise CliError(f"--shapes: {text!r} is not NxHxV (e.g. 16384x4096x128256)") from None
    if min(n, h, v) < 1:
        raise CliError(f"--shapes: {text!r} needs sizes of at least 1")
    return n, h, v
