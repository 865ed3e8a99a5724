# ruff: noqa: E702  -- `push; work; pop` on one line reads as the range it records
"""Fixture program: a training-like loop with host syncs, copies and idle gaps inside its ranges.

Domain `rl`, push/pop ranges: four `train_step` repetitions, each holding
  * `op.fwd`: an async memset and a kernel, then, outside the op range but inside the step, `.item()`
    (a device-to-host copy into pageable memory and a stream sync), as the project's example does;
  * a host sleep (a GPU idle gap while the host waits on nothing);
  * `h2d_pageable`: a host-to-device copy from pageable memory (cudaMemcpyAsync that blocks);
  * `blocking`: a plain cudaMemset and cudaMemcpy (device to host), cudaDeviceSynchronize, an event sync;
  * `two_streams`: two spin kernels that overlap on two streams (kernel time counts both, busy time once);
  * `storm`: 64 small launches.
What NVIDIA's expert rules (cuda_api_sync, cuda_memcpy_sync, cuda_memcpy_async, cuda_memset_sync,
gpu_gaps, gpu_time_util) and `nsys stats` say about it is stored beside the trace.

Run under `nsys profile --trace=cuda,nvtx --sample=none --cpuctxsw=none python tools/traces/sync_loop.py`
(tools/make_fixtures.sh OUTDIR sync_loop).
"""
from __future__ import annotations

import os
import sys
import time

import nvtx
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _tricky import check, load  # noqa: E402

D = "rl"
DTOH = 2  # cudaMemcpyDeviceToHost


def main() -> None:
    lib = load()
    dev = torch.device("cuda")
    s0 = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    x = torch.randn(1 << 16, device=dev)
    buf = torch.empty(1 << 16, device=dev)
    host = torch.empty(1 << 16)  # pageable
    # Warm-up outside any range.
    x.add_(1.0); check(lib.tl_fused(x.data_ptr(), x.numel(), s0.cuda_stream), "fused")
    check(lib.tl_spin(1000, s0.cuda_stream), "spin"); float(x[0]); torch.randn(16).to(dev)
    torch.cuda.synchronize()

    for _ in range(4):
        nvtx.push_range("train_step", domain=D)
        nvtx.push_range("op.fwd", domain=D)
        check(lib.tl_memset(buf.data_ptr(), 0, buf.numel() * 4, s0.cuda_stream), "memset")
        check(lib.tl_fused(x.data_ptr(), x.numel(), s0.cuda_stream), "fused")
        nvtx.pop_range(domain=D)
        loss = float(x[0])  # the sync after the op range, inside the step
        time.sleep(0.002)
        nvtx.push_range("h2d_pageable", domain=D); y = torch.randn(1 << 18).to(dev); nvtx.pop_range(domain=D)
        nvtx.push_range("blocking", domain=D)
        check(lib.tl_memset_sync(buf.data_ptr(), 0, buf.numel() * 4), "memset_sync")
        check(lib.tl_memcpy_sync(host.data_ptr(), x.data_ptr(), x.numel() * 4, DTOH), "memcpy_sync")
        torch.cuda.synchronize()
        ev = torch.cuda.Event(); ev.record(); ev.synchronize()
        nvtx.pop_range(domain=D)
        nvtx.push_range("two_streams", domain=D)
        side.wait_stream(s0)
        check(lib.tl_spin(200_000, s0.cuda_stream), "spin")
        check(lib.tl_spin(200_000, side.cuda_stream), "spin")
        s0.wait_stream(side)
        nvtx.pop_range(domain=D)
        nvtx.push_range("storm", domain=D)
        for _ in range(64):
            x.add_(1e-3)
        nvtx.pop_range(domain=D)
        s0.synchronize()
        nvtx.pop_range(domain=D)
    torch.cuda.synchronize()
    print("sync_loop done", loss, float(y[0]), float(host[0]))


if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):  # help only: nothing built, traced or written
        sys.exit(print(__doc__.strip()))
    main()
