"""What an ``rlkernel.phase`` range costs when no profiler is attached (contract 3: at most 2 us per range).

Times, on the host clock, N entries of ``with rlkernel.phase(name):`` (one object held, as a decorator or an
integration holds it), N calls of a ``@rlkernel.phase``-decorated function, N ``with rlkernel.phase(name):``
written in the loop (the object looked up by name each time), and N ``rlkernel.step_begin``/``step_end`` pairs,
each against the same loop with an empty body. Each figure is the median of ``--rounds`` rounds of ``--iters``
iterations. Torch-free, as the phases are. Under a profiler (nsys) the ranges are real pushes and pops and cost
what NVTX costs.

    python benchmarks/bench_phase.py [--iters 200000] [--rounds 15]
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import rlkernel  # noqa: E402
from rlkernel import phases  # noqa: E402
from rlkernel.cli import CliError, OneLineParser  # noqa: E402

LIMIT_NS = 2000.0


def _per_call_ns(loop, iters: int, rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        loop(iters)
        samples.append((time.perf_counter_ns() - t0) / iters)
    return statistics.median(samples)


def main(argv=None) -> int:
    ap = OneLineParser(prog="bench_phase", description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=15)
    try:
        args = ap.parse_args(argv)
        if args.iters < 1 or args.rounds < 1:
            raise CliError("--iters and --rounds must be >= 1")
    except CliError as exc:
        print(f"bench_phase: {exc}", file=sys.stderr)
        return exc.code

    held = rlkernel.phase("rollout")

    @rlkernel.phase("loss")
    def decorated():
        pass

    def plain():
        pass

    def empty(n):
        for _ in range(n):
            pass

    def with_held(n):
        for _ in range(n):
            with held:
                pass

    def calls_plain(n):
        for _ in range(n):
            plain()

    def calls_decorated(n):
        for _ in range(n):
            decorated()

    def made_each_time(n):
        for _ in range(n):
            with rlkernel.phase("rollout"):
                pass

    def steps(n):
        for i in range(n):
            rlkernel.step_begin(i)
            rlkernel.step_end()

    t = {name: _per_call_ns(fn, args.iters, args.rounds) for name, fn in (
        ("empty loop", empty), ("with phase (held)", with_held), ("plain call", calls_plain),
        ("decorated call", calls_decorated), ("with phase(name) each time", made_each_time), ("step_begin+end", steps))}
    costs = {"with phase (held)": t["with phase (held)"] - t["empty loop"],
             "decorated call": t["decorated call"] - t["plain call"],
             "with phase(name) each time": t["with phase(name) each time"] - t["empty loop"],
             "step_begin+end": t["step_begin+end"] - t["empty loop"]}
    print(f"command: {' '.join(sys.argv)}")
    print(f"python {sys.version.split()[0]}, profiler attached: {phases._enabled}, "
          f"median of {args.rounds} rounds x {args.iters} iterations")
    for name, ns in t.items():
        print(f"{name:28} {ns:10.1f} ns per iteration")
    worst = max(costs.values())
    for name, ns in costs.items():
        print(f"{'cost: ' + name:34} {ns:8.1f} ns per range")
    if phases._enabled:  # a tool is attached: its own cost per event is in every figure
        print(f"worst {worst:.1f} ns per range with the attached tool's own cost; the {LIMIT_NS:.0f} ns limit is "
              "for no profiler attached")
    else:
        print(f"worst {worst:.1f} ns per range, limit {LIMIT_NS:.0f} ns: {'ok' if worst <= LIMIT_NS else 'OVER'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
