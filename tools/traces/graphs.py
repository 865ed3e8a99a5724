# ruff: noqa: E702  -- `push; work; pop` on one line reads as the range it records
"""Fixture program: CUDA graph replays, traced with `--cuda-graph-trace=node`.

Each node kernel of a replay carries the correlation id of the `cudaGraphLaunch` call, so it
belongs to the ranges open around the replay, not to those around the capture (whose launch
calls run no kernel at all).

    usage: python tools/traces/graphs.py   (under nsys, by tools/make_fixtures.sh; needs a GPU)
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _tricky import check, load  # noqa: E402


def main() -> None:
    lib = load()
    dev = torch.device("cuda")
    x = torch.randn(1 << 16, device=dev)
    a = torch.randn(256, 256, device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on the capture stream, as torch requires
        x.mul_(1.0); torch.mm(a, a)
        check(lib.tl_fused(x.data_ptr(), x.numel(), s.cuda_stream), "fused")
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()

    g = torch.cuda.CUDAGraph()
    lib.tl_push_inline(0, b"capture")
    with torch.cuda.graph(g):
        x.mul_(0.5)
        b = torch.mm(a, a)
        check(lib.tl_fused(x.data_ptr(), x.numel(), torch.cuda.current_stream().cuda_stream), "fused")
    lib.tl_pop(0)
    torch.cuda.synchronize()

    for _ in range(3):
        lib.tl_push_inline(0, b"replay")
        g.replay()
        lib.tl_pop(0)
    lib.tl_push_inline(0, b"eager_after"); x.add_(1.0); lib.tl_pop(0)
    torch.cuda.synchronize()
    print("graphs done", float(b[0, 0]))


if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):  # help only: nothing built, traced or written
        sys.exit(print(__doc__.strip()))
    main()
