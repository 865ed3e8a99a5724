"""What an NVTX range costs when no profiler is attached (contracts, section 3: ranges cost nothing measurable).

Times, on the host clock, N pushes/pops of ``rlkernel.nvtx_ranges.op_range`` against an empty context manager, and
sets that against one ``rlkernel.logp`` call on a small input, so the cost is read as a fraction of real work.

    python benchmarks/bench_nvtx_overhead.py [--iters 200000] [--device cpu|cuda]

Exit codes: 0 done, 2 bad arguments (or a bad RLKERNEL_* variable), 3 --device cuda without CUDA.
"""
from __future__ import annotations

import contextlib
import statistics
import sys
import time

import torch

import rlkernel
from rlkernel.cli import CliError, OneLineParser, check_env_flags
from rlkernel.nvtx_ranges import op_range


def _per_call_ns(fn, iters: int, rounds: int = 7) -> float:
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter_ns() - t0) / iters)
    return statistics.median(samples)


def main(argv=None) -> int:
    ap = OneLineParser(prog="bench_nvtx_overhead", description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=200_000, help="pushes/pops per timed round (>= 1000)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    try:
        args = ap.parse_args(argv)
        if args.iters < 1000:  # the logp call is timed over iters // 1000 calls (at least 50)
            raise CliError(f"--iters must be >= 1000, got {args.iters}")
        if args.device == "cuda" and not torch.cuda.is_available():
            raise CliError("--device cuda: no CUDA device here", 3)
        check_env_flags()  # RLKERNEL_REQUIRE_FUSED / _VALIDATE, read by the logp call: a bad value is exit 2
    except CliError as exc:
        print(f"bench_nvtx_overhead: {exc}", file=sys.stderr)
        return exc.code

    def with_range():
        with op_range("op.logp.forward"):
            pass

    def without():
        with contextlib.nullcontext():
            pass

    ranged = _per_call_ns(with_range, args.iters)
    empty = _per_call_ns(without, args.iters)
    logits = torch.randn(64, 4096, device=args.device)
    ids = torch.randint(0, 4096, (64,), device=args.device)

    def one_call():
        rlkernel.logp(logits, ids, backend="native")
        if args.device == "cuda":
            torch.cuda.synchronize()

    call = _per_call_ns(one_call, max(args.iters // 1000, 50))
    extra = ranged - empty
    print(f"command: {' '.join(sys.argv)}")
    print(f"torch {torch.__version__} device {args.device}")
    print(f"{'op_range push+pop':28} {ranged:10.0f} ns")
    print(f"{'empty context manager':28} {empty:10.0f} ns")
    print(f"{'range cost':28} {extra:10.0f} ns")
    print(f"{'logp native 64x4096 call':28} {call:10.0f} ns  (range cost = {100 * extra / call:.2f} % of it)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
