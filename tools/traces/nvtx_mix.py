# ruff: noqa: E702  -- `push; work; pop` on one line reads as the range it records
"""Fixture program: the NVTX and launch shapes real traces contain, in one small process.

Run under `nsys profile --trace=cuda,nvtx --sample=none --cpuctxsw=none` (tools/make_fixtures.sh).
Covers: default domain with inline text, a named domain with registered strings, nesting (a range
nested in a range of the same name), a range without GPU work, memcpy/memset, a second stream, a
kernel that runs long after its range closed, a second thread with its own ranges, start/end
ranges (one ended on another thread), and CUB's own `CCCL:` ranges inside a user range.

    usage: python tools/traces/nvtx_mix.py   (under nsys, by tools/make_fixtures.sh; needs a GPU)
"""
from __future__ import annotations

import sys
import threading

import torch

sys.path.insert(0, __import__("os").path.dirname(__file__))
from _tricky import check, load  # noqa: E402


def main() -> None:
    lib = load()
    dev = torch.device("cuda")
    s0 = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    x = torch.randn(1 << 16, device=dev)
    a = torch.randn(256, 256, device=dev)
    ints = torch.arange(1 << 14, device=dev, dtype=torch.int32)
    scan = torch.empty_like(ints)
    host = torch.randn(1 << 16).pin_memory()

    def stream_ptr(s: torch.cuda.Stream) -> int:
        return s.cuda_stream

    # Warm-up outside any range: first-launch and library-init costs stay out of the ranges.
    x.mul_(1.0); torch.mm(a, a); check(lib.tl_fused(x.data_ptr(), x.numel(), stream_ptr(s0)), "fused")
    check(lib.tl_cub_scan(ints.data_ptr(), scan.data_ptr(), ints.numel(), stream_ptr(s0)), "cub")
    torch.cuda.synchronize()

    app = lib.tl_domain(b"app")
    step = lib.tl_register(app, b"step")

    # Default domain, inline text, nesting (same name nested), a range without GPU work.
    lib.tl_push_inline(0, b"outer")
    for _ in range(2):
        lib.tl_push_inline(0, b"inner"); x.mul_(2.0); torch.mm(a, a); lib.tl_pop(0)
    lib.tl_push_inline(0, b"outer"); x.sin_(); lib.tl_pop(0)
    lib.tl_push_inline(0, b"no_gpu_work"); lib.tl_pop(0)
    lib.tl_pop(0)

    # A named domain with registered strings, three instances.
    for _ in range(3):
        lib.tl_push_registered(app, step)
        x.cos_(); check(lib.tl_fused(x.data_ptr(), x.numel(), stream_ptr(s0)), "fused")
        lib.tl_pop(app)

    # Copies and sets: H2D, D2H, D2D and a memset count as GPU ops of the range.
    lib.tl_push_inline(app, b"copies")
    y = host.to(dev, non_blocking=True)
    x.copy_(y)
    check(lib.tl_memset(y.data_ptr(), 0, y.numel() * 4, stream_ptr(s0)), "memset")
    back = x.to("cpu")
    lib.tl_pop(app)

    # A second stream.
    with torch.cuda.stream(side):
        lib.tl_push_inline(app, b"side_stream")
        z = torch.randn(1 << 12, device=dev); z.exp_()
        lib.tl_pop(app)
    torch.cuda.synchronize()

    # A kernel launched in a short range keeps running after the range closes (~2 ms at ~2 GHz).
    lib.tl_push_inline(0, b"launch_then_close")
    check(lib.tl_spin(4_000_000, stream_ptr(s0)), "spin")
    lib.tl_pop(0)
    lib.tl_push_inline(0, b"queued_behind_spin"); x.add_(1.0); lib.tl_pop(0)

    # CUB inside a user range: CUB's registered-string range in domain CCCL nests under it.
    lib.tl_push_inline(0, b"cub_scan")
    check(lib.tl_cub_scan(ints.data_ptr(), scan.data_ptr(), ints.numel(), stream_ptr(s0)), "cub")
    lib.tl_pop(0)

    # Start/end ranges: one on the same thread, one started here and ended by a worker thread.
    same = lib.tl_start(0, b"startend_same_thread")
    x.neg_()
    lib.tl_end(0, same)
    cross = lib.tl_start(app, b"startend_cross_thread")
    x.abs_()
    started = threading.Event()

    def worker() -> None:
        w = torch.randn(1 << 12, device=dev)
        lib.tl_push_inline(app, b"worker")
        w.mul_(3.0); w.sqrt_()
        lib.tl_pop(app)
        started.set()
        torch.cuda.synchronize()
        lib.tl_end(app, cross)

    t = threading.Thread(target=worker)
    t.start(); started.wait(); x.add_(2.0); t.join()
    torch.cuda.synchronize()
    print("nvtx_mix done", float(back[0]), int(scan[-1]))


if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):  # help only: nothing built, traced or written
        sys.exit(print(__doc__.strip()))
    main()
