# ruff: noqa: E702  -- `push; work; pop` on one line reads as the range it records
"""Fixture program: one small torch.distributed job whose ranks share the one GPU, one rank deliberately slow.

Each rank runs STEPS steps: a `compute` range (a few matmuls and elementwise kernels) then an `allreduce` range
(gloo all-reduce of a CPU tensor: NCCL refuses two ranks on one device, and gloo launches no GPU kernel). Rank
SLOW (1) sleeps SLEEP_MS inside every one of its `compute` ranges and launches two more matmuls there, so its
compute spans are the longest and the other ranks wait for it inside `allreduce`. Ranges are in the NVTX domain
`ranks` (`ranks:compute`, `ranks:allreduce`, `ranks:step`).

    usage: RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tools/traces/ranks.py
           (one process per rank, each under its own nsys, by tools/make_fixtures.sh ranks; needs a GPU)
"""
from __future__ import annotations

import os
import sys
import time

STEPS = 4
SLOW = 1
SLEEP_MS = 20


def main() -> None:
    import nvtx
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    torch.cuda.set_device(0)
    D = "ranks"
    a = torch.randn(1024, 1024, device="cuda")
    b = torch.randn(1024, 1024, device="cuda")
    total = torch.zeros(4)
    torch.cuda.synchronize()
    for _ in range(STEPS):
        nvtx.push_range("step", domain=D)
        nvtx.push_range("compute", domain=D)
        c = a @ b; c.relu_(); c = c @ a
        if rank == SLOW:
            time.sleep(SLEEP_MS / 1000); c = c @ b; c = c @ a
        part = c.sum().reshape(1).cpu()  # the value to reduce, on the host for gloo (a sync: part of the step)
        nvtx.pop_range(domain=D)
        nvtx.push_range("allreduce", domain=D)
        t = torch.cat([part, torch.full((3,), float(rank))]); dist.all_reduce(t); total += t
        nvtx.pop_range(domain=D)
        nvtx.pop_range(domain=D)
    dist.barrier()
    dist.destroy_process_group()
    print(f"ranks: rank {rank} done", total.tolist())


if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):  # help only: nothing built, traced or written
        sys.exit(print(__doc__.strip()))
    main()
