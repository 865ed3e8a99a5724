# ruff: noqa: E702  -- `push; work; pop` on one line reads as the range it records
"""Fixture program: two child processes, each with its own named domains and kernels.

Domain ids are per process: child 0 creates `extra0` before `worker`, child 1 only `worker`, so
the same domainId names different domains in the two processes, and the same range name appears
in both (nsys reports aggregate across processes by name).

    usage: python tools/traces/multiproc.py   (under nsys, by tools/make_fixtures.sh; needs a GPU)
"""
from __future__ import annotations

import multiprocessing as mp
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


def child(k: int) -> None:
    import torch
    from _tricky import load

    lib = load()
    x = torch.randn(1 << 14, device="cuda")
    x.mul_(1.0); torch.cuda.synchronize()
    if k == 0:
        extra = lib.tl_domain(b"extra0")
        lib.tl_push_inline(extra, b"only_in_child0"); x.sin_(); lib.tl_pop(extra)
    dom = lib.tl_domain(b"worker")
    work = lib.tl_register(dom, b"proc_work")
    for _ in range(2 + k):
        lib.tl_push_registered(dom, work); x.mul_(1.5); x.add_(k); lib.tl_pop(dom)
    torch.cuda.synchronize()


def main() -> None:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=child, args=(k,)) for k in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"child exited {p.exitcode}")
    print("multiproc done")


if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):  # help only: nothing built, traced or written
        sys.exit(print(__doc__.strip()))
    main()
