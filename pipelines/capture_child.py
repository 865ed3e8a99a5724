"""The program ``pipelines.capture`` runs under nsys/ncu: ``python -m pipelines.capture_child ... --record FILE``.

For each workload: inputs, then ``--warmup`` runs outside any NVTX range (compilation, allocator growth and
first-launch costs stay out of the measured ranges), then ``--repeat`` repetitions, each inside the
workload's range (``Workload.repetition``). It writes the process's dispatch history and node record to
FILE, which the parent copies into the manifest: the records of the process that was traced.

With ``--dist-backend`` (capture --ranks) the process first joins its job's ``torch.distributed`` group from the
environment torchrun would set (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; LOCAL_RANK picks the GPU) and runs an
all_reduce after each repetition, outside the workload range: the ranks go through the repetitions in step, as
a data-parallel job does, and with NCCL the communication kernels are in the trace.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from rlkernel.cli import EXIT_BLOCKED, EXIT_OK, EXIT_USAGE, CliError, OneLineParser, fail

PROG = "pipelines.capture_child"


def build_parser() -> argparse.ArgumentParser:
    from rlkernel.workloads import DTYPES

    ap = OneLineParser(prog=f"python -m {PROG}", description=__doc__.splitlines()[0])
    ap.add_argument("--workload", action="append", required=True)
    ap.add_argument("--batch-size", type=int, required=True)
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--vocab-size", type=int, required=True)
    ap.add_argument("--top-k", type=int, required=True)
    ap.add_argument("--top-p", type=float, required=True)
    ap.add_argument("--temperature", type=float, required=True)
    ap.add_argument("--dtype", choices=tuple(DTYPES), required=True)
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--repeat", type=int, required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--device", choices=("cuda", "cpu"), required=True)
    ap.add_argument("--record", required=True, help="JSON file for the dispatch history and node record")
    ap.add_argument("--dist-backend", choices=("gloo", "nccl"),
                    help="join the torch.distributed group of the environment (RANK, WORLD_SIZE, MASTER_*)")
    return ap


def _sync(device) -> None:
    """Wait for the device and raise what its error record holds (rlkernel.check_errors; nothing on CPU)."""
    from rlkernel import errors

    errors.check_errors(device)


def join_group(backend: str, device):
    """Join the job's process group (env:// rendezvous); returns (the device for this rank, a step function that
    all-reduces a one-element tensor: on the rank's GPU with NCCL, on the CPU with gloo, which then adds no GPU
    work to the trace)."""
    import torch
    import torch.distributed as dist

    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    token = torch.ones(1, device=device if backend == "nccl" else "cpu")
    print(f"{PROG}: rank {dist.get_rank()} of {dist.get_world_size()} ({backend})", flush=True)
    return device, lambda: dist.all_reduce(token)


def run(args) -> dict:
    import torch

    from rlkernel import dispatch, env, nvtx_ranges, workloads

    if nvtx_ranges._nvtx is None:
        raise RuntimeError("blocked: the nvtx Python package is missing, the trace would have no workload ranges")
    device = torch.device(args.device)
    together = None
    if args.dist_backend:
        device, together = join_group(args.dist_backend, device)
    dtype = workloads.DTYPES[args.dtype]
    shape = workloads.Shape(args.batch_size, args.seq_len, args.vocab_size, args.top_k, args.top_p, args.temperature)
    dispatch.reset()
    timings = []
    for name in args.workload:
        w = workloads.get(name)
        inputs = w.make_inputs(shape, dtype, device, args.seed)
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            w.run(inputs)
        _sync(device)
        t1 = time.perf_counter()
        for _ in range(args.repeat):
            w.repetition(inputs)
            if together:
                together()
        _sync(device)
        t2 = time.perf_counter()
        timings.append({"workload": name, "warmup_seconds": round(t1 - t0, 6), "repeat_seconds": round(t2 - t1, 6)})
        print(f"{PROG}: {name}: {args.warmup} warm-up + {args.repeat} repetitions in {t2 - t0:.2f} s", flush=True)
        del inputs
    record = {"dispatch": dispatch.history_json(), "node": env.describe(), "timings": timings}
    if together:
        import torch.distributed as dist

        dist.destroy_process_group()
    return record


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except CliError as e:
        return fail(PROG, str(e), e.code)
    from rlkernel import FusedKernelUnavailable

    try:
        record = run(args)
    except KeyError as e:  # unknown workload
        return fail(PROG, str(e.args[0]), EXIT_USAGE)
    except FusedKernelUnavailable as e:  # RLKERNEL_REQUIRE_FUSED=1 in the environment and no fused path
        return fail(PROG, f"blocked: {e}", EXIT_BLOCKED)
    except RuntimeError as e:
        if str(e).startswith("blocked:"):
            return fail(PROG, str(e), EXIT_BLOCKED)
        raise
    tmp = f"{args.record}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, args.record)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
