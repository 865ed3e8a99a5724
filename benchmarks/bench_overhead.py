"""What a trainer's or a rollout engine's loop pays per rlkernel call, beside what the GPU pays.

For each op and shape (issue 17's table), the same call:
  b2b      issued back to back with no sync in between: (wall time from the first call to the final sync) / calls
  host     the host's time to issue one call (the same loop, stopped before the final sync)
  graph    the call replayed from a CUDA graph (calls captured back to back, replayed; CUDA events): GPU time only
  syncs    host syncs per call, counted with torch.cuda.set_sync_debug_mode(1)
with RLKERNEL_VALIDATE=1 (the default: the device error record) and =0. Medians of --runs runs.
--cpu-only times the Python layer alone on CPU tensors (argument checks, dispatch.resolve, and sample_fused's own
Python with the extension's entry stood in for by the allocation of its outputs: no kernel);
--breakdown times each layer of a fused call on CUDA tensors (host time only).

  python benchmarks/bench_overhead.py [--calls 300] [--runs 7] [--cases sample-b1,logp-n256] [--cpu-only | --breakdown]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import rlkernel  # noqa: E402
from rlkernel import dispatch, validate  # noqa: E402

V = 128256


def _case_inputs(name: str):
    g = torch.Generator(device="cuda").manual_seed(0)
    if name.startswith("sample"):
        # sample[-rows][-processed|-raw]-b{1,256}: rows = per-row temperature with a seed and an offset per row (a
        # rollout engine's call); processed / raw = return_logprobs "processed" / True (issue 38)
        parts = name.split("-")
        b = int(parts[-1][1:])
        x = torch.randn(b, V, device="cuda", generator=g) * 3
        kw = dict(top_k=50, top_p=0.9, return_logprobs="processed" if "processed" in parts else "raw" in parts)
        if "rows" in parts:
            kw.update(temperature=torch.ones(b, device="cuda"), seed=torch.arange(b, device="cuda") * 7919 + 1,
                      offset=torch.arange(b, device="cuda"))
        return lambda: rlkernel.sample(x, **kw)  # the default generator (scalar cases): graph-safe as it is
    n = {"logp-n256": 256, "logp-n16384": 16384, "logp-ent-fwd-bwd-n16384": 16384}[name]
    x = (torch.randn(n, V, device="cuda", generator=g) * 3).to(torch.bfloat16)
    ids = torch.randint(0, V, (n,), device="cuda", generator=g)
    if name != "logp-ent-fwd-bwd-n16384":
        return lambda: rlkernel.logp(x, ids)
    x.requires_grad_(True)

    def step():
        x.grad = None
        lp, ent = rlkernel.logp(x, ids, return_entropy=True)
        (lp.sum() + 0.01 * ent.sum()).backward()
    return step


CASES = ("sample-b1", "sample-b256", "logp-n256", "logp-n16384", "logp-ent-fwd-bwd-n16384")
# the log-prob variants of the sampler's cases (issue 38), run when named in --cases
SAMPLE_CASES = tuple(f"sample{rows}{lp}-b{b}" for rows in ("", "-rows") for lp in ("", "-processed", "-raw")
                     for b in (1, 256))


def back_to_back(fn, calls: int) -> tuple[float, float]:
    """(wall us per call including the drain, host us per call to issue)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t2 - t0) / calls * 1e6, (t1 - t0) / calls * 1e6


def graph_replay(fn, calls: int, replays: int = 10) -> float:
    """GPU us per call: ``calls`` calls captured in one graph, replayed ``replays`` times between two events."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * replays)


def syncs_per_call(fn, calls: int = 20) -> float:
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)
        try:
            for _ in range(calls):
                fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # torch's own notice ("Synchronization debug mode is a prototype feature ...") is not a sync
    return sum("called a synchronizing" in str(w.message) for w in caught) / calls


def host_table(title: str, steps: dict, calls: int, runs: int, *, cuda: bool) -> None:
    """One row per step: the median over ``runs`` of the host us per call of ``calls`` calls in a row (with
    ``cuda``, the queue drained before each run, untimed)."""
    print(f"| {title} | host us per call |\n| --- | --- |")
    for name, fn in steps.items():
        per = []
        for _ in range(runs):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            per.append((time.perf_counter() - t0) / calls * 1e6)
        print(f"| {name} | {statistics.median(per):.2f} |", flush=True)


@contextlib.contextmanager
def _stand_in_sampler_entries():
    """sample_fused's extension entries replaced by the allocation of their outputs (an edge a CPU run cannot reach),
    with RLKERNEL_VALIDATE=0 (the device error record needs CUDA); both restored after."""
    from rlkernel.ops.fused import sampling as sampling_fused

    saved = {k: getattr(sampling_fused, k) for k in ("_registered", "_SAMPLE_EAGER", "_SAMPLE_PROCESSED_EAGER")}
    saved_env = os.environ.get("RLKERNEL_VALIDATE")
    os.environ["RLKERNEL_VALIDATE"] = "0"
    sampling_fused._registered = True
    sampling_fused._SAMPLE_EAGER = lambda rows, *a: torch.empty(rows.shape[0], dtype=torch.int64)
    sampling_fused._SAMPLE_PROCESSED_EAGER = lambda rows, *a: (torch.empty(rows.shape[0], dtype=torch.int64),
                                                               torch.empty(rows.shape[0]))
    try:
        yield sampling_fused.sample_fused
    finally:
        for k, v in saved.items():
            setattr(sampling_fused, k, v)
        if saved_env is None:
            os.environ.pop("RLKERNEL_VALIDATE", None)
        else:
            os.environ["RLKERNEL_VALIDATE"] = saved_env


def cpu_only(calls: int, runs: int) -> None:
    """The Python layer alone: argument checks, dispatch.resolve and sample_fused's own Python, no kernel."""
    x, ids = torch.randn(256, 64), torch.randint(0, 64, (256,))
    xs = torch.randn(1, V)
    kw = dict(temperature=1.0, top_k=50, top_p=0.9, generator=None)
    with _stand_in_sampler_entries() as sample_fused:
        cases = {
            "check_logp_args": lambda: validate.check_logp_args(x, ids, 1.0, -100),
            "check_sample_args": lambda: validate.check_sample_args(x, 1.0, 50, 0.9, None),
            "dispatch.resolve": lambda: dispatch.resolve("logp.forward", "auto", False, x.device, x.dtype),
            "sample_fused B=1 (entry stood in, validation off)": lambda: sample_fused(xs, return_logprobs=False, **kw),
            "sample_fused B=1 processed (stood in, off)": lambda: sample_fused(xs, return_logprobs="processed",
                                                                                 **kw),
            "sample_fused B=1 True (stood in, off)": lambda: sample_fused(xs, return_logprobs=True, **kw),
        }
        host_table("python layer (CPU tensors, no kernel)", cases, calls, runs, cuda=False)


def breakdown(calls: int, runs: int) -> None:
    """Host us per call of each layer of a fused call on CUDA tensors (logp N=256 bf16, sample B=1 fp32)."""
    from rlkernel import errors
    from rlkernel.ops import rows as ops_rows
    from rlkernel.ops.fused import logp as logp_fused
    from rlkernel.ops.fused import sampling as sampling_fused

    x = (torch.randn(256, V, device="cuda") * 3).to(torch.bfloat16)
    ids = torch.randint(0, V, (256,), device="cuda")
    xs = torch.randn(1, V, device="cuda")
    rows = ops_rows.as_rows(x)
    steps = {
        "check_logp_args": lambda: validate.check_logp_args(x, ids, 1.0, -100),
        "check_sample_args": lambda: validate.check_sample_args(xs, 1.0, 50, 0.9, None),
        "dispatch.resolve": lambda: dispatch.resolve("logp.forward", "auto", False, x.device, x.dtype),
        "errors.begin": lambda: errors.begin("logp.forward", x.device, x.shape[:-1], V),
        "errors.after_call": lambda: errors.after_call(x.device, False),
        "as_rows": lambda: ops_rows.as_rows(x),
        "torch.ops.rlkernel.logp_forward": lambda: torch.ops.rlkernel.logp_forward(rows, ids, 1.0, -100, False),
        "rlkernel._C.logp_forward_eager": lambda: logp_fused._EAGER(rows, ids, 1.0, -100, False, 0, 0, 1),
        "torch.ops.rlkernel.sample": lambda: torch.ops.rlkernel.sample(xs, 1.0, 50, 0.9, None),
        "rlkernel._C.sample_eager": lambda: sampling_fused._SAMPLE_EAGER(
            xs, 1.0, 50, 0.9, None, 0, 0, 0.0, None, None, None, None, False, 0, None, 0, None),
        "eager_entry_ok": lambda: ops_rows.eager_entry_ok(rows, ids),
        "torch.empty_like (one small launch-free op)": lambda: torch.empty_like(ids),
        "ids.add_(0) (one kernel launch)": lambda: ids.add_(0),
        "logp_fused (no checks, no dispatch)": lambda: logp_fused.logp_fused(
            x, ids, temperature=1.0, ignore_index=-100, return_entropy=False, inplace_backward=False),
        "sample_fused (no checks, no dispatch)": lambda: sampling_fused.sample_fused(
            xs, temperature=1.0, top_k=50, top_p=0.9, generator=None, return_logprobs=False),
        "rlkernel.logp": lambda: rlkernel.logp(x, ids),
        "rlkernel.sample": lambda: rlkernel.sample(xs, top_k=50, top_p=0.9),
    }
    host_table("layer (CUDA tensors)", steps, calls, runs, cuda=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=300, help="calls per timed loop (default 300)")
    ap.add_argument("--runs", type=int, default=7, help="runs per figure; the median is reported (default 7)")
    ap.add_argument("--cases", default=",".join(CASES),
                    help=f"comma-separated, from {', '.join(dict.fromkeys(CASES + SAMPLE_CASES))} "
                         f"(default: {', '.join(CASES)})")
    ap.add_argument("--cpu-only", action="store_true", help="time the Python layer alone (no GPU needed)")
    ap.add_argument("--breakdown", action="store_true", help="host time of each layer of a fused call (CUDA)")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore", rlkernel.FallbackWarning)
    cases = [c for c in args.cases.split(",") if c]
    unknown = set(cases) - set(CASES) - set(SAMPLE_CASES)
    bad = ("--calls and --runs must be >= 1" if args.calls < 1 or args.runs < 1
           else "--cpu-only and --breakdown time fixed layers: give them without --cases"
           if (args.cpu_only or args.breakdown) and args.cases != ",".join(CASES)
           else "--cpu-only and --breakdown are two modes: give one" if args.cpu_only and args.breakdown
           else f"unknown case(s) {', '.join(sorted(unknown))}" if unknown else None)
    if bad:
        print(f"bench_overhead: {bad}", file=sys.stderr)
        return 2
    if args.cpu_only:
        cpu_only(args.calls * 10, args.runs)
        return 0
    if not torch.cuda.is_available():
        print("bench_overhead: needs CUDA (or --cpu-only)", file=sys.stderr)
        return 3
    if args.breakdown:
        breakdown(args.calls, args.runs)
        return 0
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, calls {args.calls}, runs {args.runs}")
    print("| case | validate | syncs/call | b2b us/call | host us/call | graph us/call | b2b - graph |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in cases:
        fn = _case_inputs(name)
        calls = args.calls if "16384" not in name else max(20, args.calls // 10)
        for mode in ("1", "0"):
            os.environ["RLKERNEL_VALIDATE"] = mode
            for _ in range(5):
                fn()
            syncs = syncs_per_call(fn)
            b2b, host = zip(*(back_to_back(fn, calls) for _ in range(args.runs)), strict=True)
            graph = statistics.median(graph_replay(fn, min(calls, 20)) for _ in range(3))
            b, h = statistics.median(b2b), statistics.median(host)
            print(f"| {name} | {mode} | {syncs:g} | {b:.1f} | {h:.1f} | {graph:.1f} | {b - graph:+.1f} |",
                  flush=True)
        rlkernel.check_errors()
        del fn
        torch.cuda.empty_cache()
    with dispatch.recording():
        pass
    print("dispatch:", sorted({(r.op, r.status) for r, _ in dispatch.history()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
