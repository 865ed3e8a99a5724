# ruff: noqa: E702  -- `push; work; pop` on one line reads as the range it records
"""Fixture program: start/end ranges in a named domain, the way verl's timers annotate a training step.

Through the `nvtx` package (`nvtx.start_range(message, domain=...)` / `nvtx.end_range`), domain `verl`:
three `step` ranges, each holding `gen`, then `old_log_prob` and `ref` that overlap without nesting (the
first ends while the second is open), then `update_actor` with a blocking `.item()` inside; a push/pop
range inside a start/end one; and `async_rollout`, started on the main thread and ended by a worker thread
that launched its own kernels meanwhile (nsys attributes nothing to such a range).

Run under `nsys profile --trace=cuda,nvtx --sample=none --cpuctxsw=none python tools/traces/verl_ranges.py`
(tools/make_fixtures.sh OUTDIR verl_ranges).
"""
from __future__ import annotations

import sys
import threading

import nvtx
import torch

D = "verl"


def main() -> None:
    dev = torch.device("cuda")
    x = torch.randn(1 << 16, device=dev)
    a = torch.randn(256, 256, device=dev)
    # Warm-up outside any range.
    x.mul_(1.0); x.sin_(); x.cos_(); x.exp_(); x.abs_(); torch.mm(a, a); float(x[0])
    torch.cuda.synchronize()

    for _ in range(3):
        step = nvtx.start_range(message="step", domain=D)
        gen = nvtx.start_range(message="gen", domain=D)
        x.mul_(0.5); torch.mm(a, a)
        nvtx.end_range(gen)
        old = nvtx.start_range(message="old_log_prob", domain=D)
        x.sin_()
        ref = nvtx.start_range(message="ref", domain=D)
        x.cos_()
        nvtx.end_range(old)  # overlaps `ref`: start/end ranges need not nest
        x.exp_()
        nvtx.end_range(ref)
        upd = nvtx.start_range(message="update_actor", domain=D)
        nvtx.push_range("optimizer", domain=D); torch.mm(a, a); nvtx.pop_range(domain=D)
        loss = float(x.sum())  # a blocking copy to the host inside the range
        nvtx.end_range(upd)
        nvtx.end_range(step)

    rollout = nvtx.start_range(message="async_rollout", domain=D)
    x.abs_()
    started = threading.Event()

    def worker() -> None:
        w = torch.randn(1 << 12, device=dev)
        nvtx.push_range("worker", domain=D); w.mul_(3.0); w.sqrt_(); nvtx.pop_range(domain=D)
        started.set()
        torch.cuda.synchronize()
        nvtx.end_range(rollout)

    t = threading.Thread(target=worker)
    t.start(); started.wait(); x.add_(2.0); t.join()
    torch.cuda.synchronize()
    print("verl_ranges done", loss)


if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):  # help only: nothing built, traced or written
        sys.exit(print(__doc__.strip()))
    main()
