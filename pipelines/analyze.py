"""python -m pipelines.analyze: DuckDB SQL over nsys SQLite exports, CSV + HTML reports, fused verdicts.

The numbers equal NVIDIA's own reports for the same file (`nsys stats --report cuda_gpu_kern_sum,nvtx_sum,
nvtx_kern_sum,nvtx_gpu_proj_sum`); the verdicts say, per op call and workload repetition, whether the fused
kernels ran. See docs/trace-schema.md for the export tables read, and queries/ for every question asked.
"""
from __future__ import annotations

import argparse
import math
import os
import pathlib
import sys
import time

import pandas as pd

from pipelines import analysis, compare, cross_rank, durations, inputs, outdir, phase_view, ranks, report, trace_db
from pipelines.inputs import UsageError
from rlkernel import textsafe
from rlkernel.cli import (
    EXIT_BLOCKED,
    EXIT_CHECK_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    OneLineParser,
    message_prefix,
    prog_name,
)

# rlkernel.cli imports neither torch nor the rest of rlkernel: a bare trace analyzes without torch.
MODULE = "pipelines.analyze"
PROG = MODULE  # what its lines start with: main sets the name the user typed (rlkernel-analyze, ...)
THRESHOLD_PCT = 5.0  # --compare: a fused workload this many percent slower is a regression

# --out names the report folder itself (replaced whole); capture's and the profile suite's --output-dir name a
# parent folder. An --output-dir alias would give one flag two meanings: a wrong flag is answered instead.
_OUT_HINT = ("did you mean --out? it names the report folder itself, replaced whole; capture's and the "
             "profile suite's --output-dir name a parent folder")


def parser(prog: str = f"python -m {MODULE}") -> argparse.ArgumentParser:
    p = OneLineParser(
        hints={f: _OUT_HINT for f in ("--output-dir", "--outdir", "--out-dir", "--output", "--output-directory")},
        prog=prog,
        description="Analyze nsys SQLite exports with DuckDB: kernel and NVTX-range summaries equal to nsys stats, "
                    "fused/native/fallback verdicts per op call and workload repetition, CSV + one HTML report.",
        epilog="With no INPUT: the newest complete run under ./runs, else the example trace bundled with the "
               "package. Outputs: kernel_summary.csv, range_summary.csv, range_kernels.csv, dispatch.csv, "
               "gaps.csv and utilization.csv (as nsys analyze's gpu_gaps and gpu_time_util), repetition_gaps.csv, "
               "bandwidth.csv (when the manifest gives bytes), steps.csv and phases.csv (when the trace has phases: "
               "rlkernel.phase/step ranges, --phase, --step-range; the headline atop report.html and printed), "
               "compare.csv and compare.json (with --compare), "
               "report.html; CSV text cells that a spreadsheet would take for a formula (=, +, -, @) get a leading ' "
               "(docs/contracts.md, section 9). "
               "Exit codes: 0 done, 1 a requested check failed (--require-fused, --require-no-sync, --compare), "
               "2 bad input, 3 this machine lacks the sqlite extension package.")
    p.add_argument("inputs", nargs="*", metavar="INPUT",
                   help="a run directory of pipelines.capture (trace.sqlite + manifest.json) "
                        "or any .sqlite nsys export")
    p.add_argument("--out", metavar="DIR", type=pathlib.Path,
                   help="the report folder itself, not a parent folder: it holds the CSVs and report.html and "
                        "nothing else, replaced as a whole by each run (default: the run's report/, or "
                        "reports/<trace stem>/); with several INPUTs, one subfolder per input")
    p.add_argument("--fused-pattern", metavar="GLOB", action="append", default=[],
                   help="kernel-name glob proving the fused path, added to rlkernel_* and to the registry's and "
                        "the manifest's; matched against the short and the demangled name")
    p.add_argument("--range", metavar="NAME", action="append", default=[], dest="ranges",
                   help="also judge this NVTX range as a workload (`domain:name`, `:name` for the default "
                        "domain, or the bare name in any domain)")
    p.add_argument("--phase", metavar="RANGE", action="append", default=[], dest="phases",
                   help="also treat this NVTX range as a phase of the training step (--range's matching rules; "
                        "the rlkernel domain's phase:<name> ranges are phases anyway): steps.csv, phases.csv and "
                        "the headline")
    p.add_argument("--step-range", metavar="RANGE",
                   help="the NVTX range that is one training step (--range's matching rules; default: the "
                        "rlkernel domain's phase:step, from rlkernel.step())")
    p.add_argument("--no-step-view", action="store_true",
                   help="leave the RL-step view out (no steps.csv, phases.csv, headline), phase ranges or not: "
                        "what the view costs, timed (benchmarks/bench_analyze.py --phase-steps)")
    p.add_argument("--require-fused", action="store_true",
                   help="after writing the reports, exit 1 when a workload that must be fused (one with "
                        "fused_ops, or a *-fused range) or one of its required op ranges is not fused")
    p.add_argument("--require-no-sync", action="store_true",
                   help="after writing the reports, exit 1 when a fused op range, a repetition of a fused single-op "
                        "workload or a --range instance holds a host sync (NVIDIA's rules cuda_api_sync, "
                        "cuda_memcpy_sync, cuda_memcpy_async, cuda_memset_sync), naming the instance and the call")
    p.add_argument("--compare", metavar="BASELINE", type=pathlib.Path,
                   help="a baseline run directory or .sqlite: per workload and kernel, both sides' instance counts "
                        "and median time per instance, deltas and verdict changes (compare.csv, compare.json and "
                        "the HTML); exit 1 when a fused workload's median GPU busy time per repetition regresses")
    p.add_argument("--threshold", metavar="PCT", type=float, default=None,
                   help=f"--compare: percent slower that counts as a regression (default {THRESHOLD_PCT:g})")
    p.add_argument("--force", action="store_true",
                   help="--compare: write the comparison even when the runs are not comparable (another GPU model, "
                        "other workloads or shapes, another kernel set), marked as not comparable; without it such "
                        "a comparison exits 2 saying why. With it the exit code is the comparison's (0, or 1 on a "
                        "regression), and one line on stderr says why the runs were not comparable")
    p.add_argument("--ranks", metavar="DIR", type=pathlib.Path,
                   help="a folder of per-rank exports or run directories (rank from `rank<N>` in the names, else "
                        "the sorted order), or one multi-process export split by process (the processes with GPU "
                        "work, numbered by device and pid): each rank analysed in parallel, then ranks.csv, "
                        "cross_rank.csv, the per-rank CSVs with a rank column and one report.html")
    p.add_argument("--executor", metavar="WHERE", default="local",
                   help="--ranks: `local` (a process pool, the default) or `dask://HOST:PORT` (an existing Dask "
                        "cluster whose workers read the exports from the same paths; needs rlkernel[dask])")
    p.add_argument("--jobs", metavar="N", type=int,
                   help="--ranks with the local executor: processes (default: min(cores, ranks))")
    return p


def analyze_source(src: analysis.Source, args: argparse.Namespace) -> analysis.Result:
    try:
        return analysis.analyze(src, patterns=args.fused_pattern, ranges=args.ranges,
                                phases=None if args.no_step_view else args.phases, step_range=args.step_range)
    except phase_view.PhaseError as e:
        raise UsageError(str(e)) from None
    except trace_db.NUMERIC_ERRORS as e:
        raise trace_db.out_of_range(src.trace, e) from None


def compare_frames(cur: analysis.Result, base: analysis.Result, threshold: float) -> pd.DataFrame:
    try:
        return compare.frame(cur, base, threshold)
    except trace_db.NUMERIC_ERRORS as e:
        raise trace_db.out_of_range(base.source.trace, e) from None


def outputs(res: analysis.Result, cmp: pd.DataFrame | None, fails: list[str],
            cmp_meta: dict | None = None) -> dict[str, bytes]:
    files = {f"{name}.csv": report.csv_bytes(df, analysis.COLUMNS.get(name, list(df.columns)))
             for name, df in res.tables.items()}  # steps.csv: one pct_<phase> column per phase
    if cmp is not None:
        files["compare.csv"] = report.csv_bytes(cmp, list(cmp.columns))
        files["compare.json"] = compare.to_json(cmp, cmp_meta or {})
    files["report.html"] = report.render_html(res, res.tables, cmp, analysis.COLUMNS, fails, cmp_meta)
    return files


def check_outputs(outs: list[pathlib.Path]) -> None:
    """Every output directory can be replaced as a whole, checked before any analysis: nothing is written
    when one cannot."""
    seen: dict[pathlib.Path, int] = {}
    for out in outs:
        key = pathlib.Path(os.path.abspath(out))
        if key in seen:
            raise UsageError(f"two INPUTs would write their reports to the same directory {out}; "
                             "give them different names or run them one at a time")
        seen[key] = 1
        try:
            outdir.check_target(out)
        except outdir.OutputError as e:
            raise UsageError(str(e)) from None


def comparison_meta(res: analysis.Result, inp: pathlib.Path, base: analysis.Result, args) -> dict:
    """Both sides named, and the comparability verdict; UsageError (exit 2, one line) when the runs are not
    comparable and --force was not given."""
    reasons = compare.comparability(res, base)
    if reasons and not args.force:
        raise UsageError(f"{inp} is not comparable with the baseline {args.compare}: {'; '.join(reasons)} "
                         "(--force writes the comparison anyway, marked as not comparable)")
    return {"baseline": compare.describe(base, args.compare), "current": compare.describe(res, inp),
            "comparable": not reasons, "reasons": reasons, "forced": bool(reasons), "threshold_pct": args.threshold,
            "gate": "median GPU busy time per repetition of each fused workload, and its fused verdict"}


def check_ranges(names: list[str], range_tables: list[pd.DataFrame]) -> None:
    """Every --range NAME matches a range of some input (`domain:name`, `:name`, or the bare message, as
    analysis.workload_specs matches them); else a usage error naming the closest range names. ``range_tables``:
    each input's range_summary (--ranks: one, the union of the ranks')."""
    import difflib

    several = len(range_tables) > 1
    ranges = sorted({r for table in range_tables for r in table["range"]})
    for name in names:
        if any(r == name or r.endswith(":" + name) for r in ranges):
            continue
        if not ranges:
            raise UsageError(f"--range {name}: the input{'s have' if several else ' has'} no NVTX ranges")
        messages = sorted({r.split(":", 1)[1] for r in ranges} | set(ranges))
        close = difflib.get_close_matches(name, messages, n=3, cutoff=0.5)
        hint = f"closest: {', '.join(close)}" if close else \
            f"its ranges include {', '.join(ranges[:3])}{', ...' if len(ranges) > 3 else ''}"
        raise UsageError(f"--range {name}: no such range in {'any input' if several else 'the input'}; {hint}")


def run(args: argparse.Namespace) -> int:
    if args.compare is None and (args.force or args.threshold is not None):
        raise UsageError("--threshold and --force go with --compare BASELINE (they tune the comparison)")
    args.threshold = THRESHOLD_PCT if args.threshold is None else args.threshold
    if not math.isfinite(args.threshold) or args.threshold < 0:
        raise UsageError(f"--threshold must be a finite number >= 0, got {args.threshold}")
    if any(not p.strip() for p in args.fused_pattern):
        raise UsageError("--fused-pattern: an empty glob matches no kernel name; give a glob such as 'liger_*'")
    if args.no_step_view and (args.phases or args.step_range):
        raise UsageError("--no-step-view leaves the RL-step view out: give it without --phase and --step-range")
    if args.ranks is not None or args.executor != "local" or args.jobs is not None:
        return run_ranks(args)
    paths = [pathlib.Path(i) for i in args.inputs] or [default_input()]
    sources = [inputs.resolve(i) for i in paths]
    base_src = inputs.resolve(args.compare) if args.compare is not None else None
    outs = [inputs.out_dir_for(s, args.out, len(sources) > 1) for s in sources]
    check_outputs(outs)
    # Analyze everything (baseline included) before writing anything: bad input leaves no half report.
    results = [analyze_source(s, args) for s in sources]
    check_ranges(args.ranges, [res.tables["range_summary"] for res in results])
    base = analyze_source(base_src, args) if base_src is not None else None
    metas = [None] * len(results)
    if base is not None:
        metas = [comparison_meta(res, inp, base, args) for res, inp in zip(results, paths, strict=True)]
    compares = [compare_frames(res, base, args.threshold) if base is not None else None for res in results]
    rc = EXIT_OK
    for res, out, cmp, meta in zip(results, outs, compares, metas, strict=True):
        fails = analysis.failures(res) if args.require_fused else []
        syncs = analysis.sync_failures(res) if args.require_no_sync else []
        try:
            written = outdir.replace_dir(out, outputs(res, cmp, fails + [f"host sync: {f}" for f in syncs], meta),
                                         on_wait=lambda out=out: say(
                                             f"{PROG}: waiting for another run writing beside {out}", sys.stderr))
        except outdir.OutputError as e:
            raise UsageError(str(e)) from None
        say(f"{PROG}: wrote {len(written)} files to {out} ({res.seconds:.1f} s)")
        if res.phase_view is not None and res.phase_view.headline:
            say(f"  {res.phase_view.headline}")
        for r in res.workloads.itertuples(index=False):
            say(f"  {r.range}: {r.verdict} ({r.instances} repetitions, {durations.fmt_ns(r.mean_gpu_busy_ns)} GPU busy "
                "each)")
        for f in fails:
            say(f"{PROG}: not fused: {f}", sys.stderr)
            rc = EXIT_CHECK_FAILED
        for f in syncs:
            say(f"{PROG}: host sync: {f}", sys.stderr)
            rc = EXIT_CHECK_FAILED
        if cmp is not None:
            if meta and not meta["comparable"]:
                say(f"{PROG}: --force: compared although not comparable ({'; '.join(meta['reasons'])}); the "
                    "comparison is marked so, and only a regression makes the exit code 1", sys.stderr)
            for r in cmp[cmp["kind"] == "workload"].itertuples(index=False):
                say(compare_line(r))
            for r in cmp[cmp["regression"]].itertuples(index=False):
                say(f"{PROG}: {regression_line(r, args.threshold)}", sys.stderr)
                rc = EXIT_CHECK_FAILED
    return rc


def _known(v) -> bool:
    return not (v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)))


def regression_line(r, threshold: float) -> str:
    """One regressed workload of compare.csv in words; a side without the workload (a FULL OUTER JOIN's NULLs)
    is said to be missing, never printed as None, <NA> or nan%."""
    verdicts = (f"{r.base_verdict if _known(r.base_verdict) else 'missing in the baseline'} -> "
                f"{r.cur_verdict if _known(r.cur_verdict) else 'missing now'}")
    reps = (f"{int(r.base_instances) if _known(r.base_instances) else 'no'} -> "
            f"{int(r.cur_instances) if _known(r.cur_instances) else 'no'} repetitions")
    if _known(r.base_med_ns) and _known(r.cur_med_ns):
        delta = f"delta {r.delta_pct}%" if _known(r.delta_pct) else "no delta (the baseline's median is 0)"
        return (f"regression: {r.name}: {verdicts}, median {durations.fmt_ns(r.base_med_ns)} -> "
                f"{durations.fmt_ns(r.cur_med_ns)} GPU busy per repetition ({reps}), {delta} (threshold {threshold}%)")
    gone = " or ".join(side for side, v in (("the baseline", r.base_med_ns), ("this run", r.cur_med_ns))
                        if not _known(v))
    return f"regression: {r.name}: {verdicts} ({reps}); no median GPU busy time in {gone}, so no delta"


def default_input() -> pathlib.Path:
    """inputs.default_input, said on the terminal: a bare command must not leave the reader guessing what it read."""
    path = inputs.default_input()
    if path == inputs.EXAMPLE_DIR:
        say(f"{PROG}: no INPUT given and no complete run under ./runs: analysing the example trace bundled with the "
            f"package ({path})", sys.stderr)
    else:
        say(f"{PROG}: no INPUT given: analysing the newest complete run under ./runs, {path}", sys.stderr)
    return path


def compare_line(r) -> str:
    """One terminal line per workload of --compare: its change in median GPU busy time per repetition, gated or not."""
    if pd.isna(r.base_med_ns) or pd.isna(r.cur_med_ns):
        change = "only in the baseline" if pd.isna(r.cur_med_ns) else "not in the baseline"
    else:
        change = f"{r.delta_pct:+.1f} % GPU busy vs baseline" if not pd.isna(r.delta_pct) else "no baseline time"
    if r.regression:
        verdict = "REGRESSION" + (f" ({r.base_verdict} -> {r.cur_verdict})" if r.base_verdict != r.cur_verdict else "")
    elif r.base_verdict == r.cur_verdict == "native":
        verdict = "no regression (native workload: not gated)"
    else:
        verdict = "no regression"
    return f"  {r.name}: {change}, {verdict}"


def run_ranks(args: argparse.Namespace) -> int:
    """--ranks DIR: discover the ranks, map them (a local process pool or a Dask cluster: pipelines.ranks),
    reduce them (pipelines.cross_rank), write one report folder."""
    if args.ranks is None:
        raise UsageError("--executor and --jobs go with --ranks DIR")
    if args.inputs or args.compare is not None:
        raise UsageError("--ranks DIR takes no INPUT and no --compare: it analyses the ranks in DIR together")
    if args.jobs is not None and args.jobs < 1:
        raise UsageError(f"--jobs must be at least 1, got {args.jobs}")
    try:
        specs = ranks.discover(args.ranks)
        name = pathlib.Path(args.ranks).resolve().name
        title = f"{name}: {len(specs)} ranks"
        out = args.out if args.out is not None else cross_rank.default_out(name)
        check_outputs([out])
        phases = None if args.no_step_view else tuple(args.phases)
        jobs = [ranks.RankJob(s, tuple(args.fused_pattern), tuple(args.ranges), phases=phases,
                              step_range=args.step_range) for s in specs]
        t0 = time.perf_counter()
        partials = ranks.run_jobs(jobs, args.executor, args.jobs)
    except ranks.RanksError as e:
        raise UsageError(str(e)) from None
    except ranks.ExecutorUnavailable as e:
        raise trace_db.ExtensionMissing(str(e)) from None
    analysis.progress(f"{len(specs)} ranks mapped in {time.perf_counter() - t0:.1f} s; reducing")
    red = cross_rank.reduce(partials)
    check_ranges(args.ranges, [red.tables["range_summary"]])
    try:
        cross_rank.check_phase_names(red, args.phases, args.step_range)
    except phase_view.PhaseError as e:
        raise UsageError(str(e)) from None
    fails = cross_rank.failures(red) if args.require_fused else []
    syncs = cross_rank.sync_failures(red) if args.require_no_sync else []
    files = cross_rank.outputs(red, title, fails + [f"host sync: {f}" for f in syncs])
    try:
        written = outdir.replace_dir(out, files, on_wait=lambda: say(
            f"{PROG}: waiting for another run writing beside {out}", sys.stderr))
    except outdir.OutputError as e:
        raise UsageError(str(e)) from None
    analysis.progress(f"{len(specs)} ranks reduced and written at {time.perf_counter() - t0:.1f} s")
    say(f"{PROG}: wrote {len(written)} files to {out} ({len(specs)} ranks)")
    for line in cross_rank.headline(cross_rank.summary(red.cross)):
        say(line)
    for line in cross_rank.phase_lines(red):
        say(line)
    if cross_rank.no_comm_kernels(red.cross):
        say("  note: " + cross_rank.COMM_NOTE.format(patterns=", ".join(ranks.COMM_PATTERNS)))
    for f in fails:
        say(f"{PROG}: not fused: {f}", sys.stderr)
    for f in syncs:
        say(f"{PROG}: host sync: {f}", sys.stderr)
    return EXIT_CHECK_FAILED if fails or syncs else EXIT_OK


def say(line: str, file=None) -> None:
    """Print one line with the names in it escaped for the terminal (a range or kernel name can hold ESC,
    NUL or newlines: rlkernel.textsafe.terminal)."""
    print(textsafe.terminal(line), file=file or sys.stdout, flush=True)


def verdict(argv, prog: str = f"python -m {MODULE}") -> tuple[int, str]:
    """The analyzer run as ``main`` runs it (reports written, the lines of its checks printed), returning its exit
    code and, for a 2 or 3, the one-line reason instead of printing it ("" otherwise): what a caller that judges a
    run (``pipelines.capture --require-fused``) reads, rather than scraping stderr."""
    try:
        args = parser(prog).parse_args(argv)  # bad usage: CliError, one line and exit 2 (not argparse's usage block)
        return run(args), ""
    except CliError as e:
        return e.code, str(e)
    except (trace_db.TraceError, UsageError) as e:
        return EXIT_USAGE, str(e)
    except trace_db.ExtensionMissing as e:
        return EXIT_BLOCKED, str(e)
    except KeyboardInterrupt:  # the reports are swapped in whole (outdir.replace_dir): none or the complete set
        return EXIT_INTERRUPTED, "interrupted (Ctrl-C)"


def main(argv=None) -> int:
    global PROG  # one CLI run per process: its lines name the command as typed, a caller's argv the module
    prog = prog_name(MODULE, sys.argv[0] if argv is None else None)
    PROG = message_prefix(prog)
    rc, why = verdict(argv, prog)
    if why:
        say(f"{PROG}: {why}", sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
