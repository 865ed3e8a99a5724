"""CUDA-event timing and peak-memory helpers of bench_logp.py, bench_linear_logp.py and bench_linear_logp_loss.py (a
module, not a script). They need a CUDA device; importing this needs only torch."""
from __future__ import annotations

import statistics

import torch


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
