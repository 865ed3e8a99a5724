"""python -m pipelines.analyze: DuckDB SQL over nsys SQLite exports, CSV + HTML reports, fused verdicts.

The numbers equal NVIDIA's own reports for the same file (`nsys stats --report cuda_gpu_kern_sum,nvtx_sum,
nvtx_kern_sum,nvtx_gpu_proj_sum`); the verdicts say, per op call and workload repetition, whether the fused
kernels ran. See docs/trace-schema.md for the export tables read, and queries/ for every question asked.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import duckdb
import pandas as pd

# The exit codes come from the package, not rlkernel.cli (same values): rlkernel would import torch.
from pipelines import EXIT_BLOCKED, EXIT_CHECK_FAILED, EXIT_OK, EXIT_USAGE, analysis, report, sql, trace_db

PROG = "pipelines.analyze"
EXAMPLE_DIR = pathlib.Path(__file__).resolve().parent / "example"


class UsageError(Exception):
    pass


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipelines.analyze",
        description="Analyze nsys SQLite exports with DuckDB: kernel and NVTX-range summaries equal to nsys stats, "
                    "fused/native/fallback verdicts per op call and workload repetition, CSV + one HTML report.",
        epilog="With no INPUT: the newest complete run under ./runs, else the example trace bundled with the "
               "package. Outputs: kernel_summary.csv, range_summary.csv, range_kernels.csv, dispatch.csv, "
               "bandwidth.csv (when the manifest gives bytes), compare.csv (with --compare), report.html. "
               "Exit codes: 0 done, 1 a requested check failed (--require-fused, --compare), "
               "2 bad input, 3 this machine lacks the sqlite extension package.")
    p.add_argument("inputs", nargs="*", metavar="INPUT",
                   help="a run directory of pipelines.capture (trace.sqlite + manifest.json) "
                        "or any .sqlite nsys export")
    p.add_argument("--out", metavar="DIR", type=pathlib.Path,
                   help="output directory (default: the run's report/, or reports/<trace stem>/); "
                        "with several INPUTs, one subdirectory per input")
    p.add_argument("--fused-pattern", metavar="GLOB", action="append", default=[],
                   help="kernel-name glob proving the fused path, added to the registry's and the manifest's "
                        "(default when none: rlkernel_*); matched against the short and the demangled name")
    p.add_argument("--range", metavar="NAME", action="append", default=[], dest="ranges",
                   help="also judge this NVTX range as a workload (`domain:name`, `:name` for the default "
                        "domain, or the bare name in any domain)")
    p.add_argument("--require-fused", action="store_true",
                   help="after writing the reports, exit 1 when a workload that must be fused (one with "
                        "fused_ops, or a *-fused range) or one of its required op ranges is not fused")
    p.add_argument("--compare", metavar="BASELINE", type=pathlib.Path,
                   help="a baseline run directory or .sqlite: per workload and kernel time deltas and verdict "
                        "changes (compare.csv and the HTML); exit 1 on a regression of a fused workload")
    p.add_argument("--threshold", metavar="PCT", type=float, default=5.0,
                   help="--compare: percent slower that counts as a regression (default 5)")
    return p


def newest_run(root: pathlib.Path) -> pathlib.Path | None:
    """The newest complete run directory (names start with a UTC timestamp, so they sort by time)."""
    if not root.is_dir():
        return None
    runs = [d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".") and
            not d.name.endswith("-failed") and (d / "trace.sqlite").is_file()]
    return max(runs, key=lambda d: d.name, default=None)


def read_manifest(path: pathlib.Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise trace_db.TraceError(f"{path}: not a readable JSON manifest ({str(e).splitlines()[0][:160]})") from None
    if not isinstance(data, dict) or not isinstance(data.get("workloads", []), list):
        raise trace_db.TraceError(f"{path}: not a run manifest (no workloads list)")
    return data


def resolve(inp: pathlib.Path) -> analysis.Source:
    """An INPUT -> what to analyze. Raises TraceError naming the file and the problem."""
    if inp.is_dir():
        trace = inp / "trace.sqlite"
        manifest = read_manifest(inp / "manifest.json") if (inp / "manifest.json").is_file() else None
        if not trace.is_file():
            why = f" (the capture failed: {manifest.get('error')})" if manifest and manifest.get("status") == "failed" \
                else ""
            raise trace_db.TraceError(f"{inp}: run directory without a trace (no trace.sqlite){why}")
        prov = None
        if (inp / "recorded.json").is_file():
            prov = json.loads((inp / "recorded.json").read_text())
        ncu = inp / "ncu.csv"
        return analysis.Source(trace, inp, manifest, ncu if ncu.is_file() else None, prov)
    if inp.suffix == ".nsys-rep":
        raise trace_db.TraceError(f"{inp}: an nsys report, not its SQLite export; run "
                                  f"`nsys export --type sqlite --output {inp.with_suffix('.sqlite')} {inp}`")
    if not inp.exists():
        raise trace_db.TraceError(f"{inp}: no such file or directory")
    return analysis.Source(inp)


def default_input() -> pathlib.Path:
    run = newest_run(pathlib.Path("runs"))
    if run is not None:
        return run
    if (EXAMPLE_DIR / "trace.sqlite").is_file():
        return EXAMPLE_DIR
    raise UsageError("no INPUT given, no run under ./runs and no bundled example in this install; "
                     "pass a run directory or a .sqlite nsys export")


def out_dir_for(src: analysis.Source, out: pathlib.Path | None, several: bool) -> pathlib.Path:
    stem = src.run_dir.name if src.run_dir else src.trace.stem
    if out is not None:
        return out / stem if several else out
    if src.run_dir is not None and src.run_dir.resolve() != EXAMPLE_DIR.resolve():
        return src.run_dir / "report"
    return pathlib.Path("reports") / ("example" if src.run_dir == EXAMPLE_DIR else stem)


def compare_frames(cur: analysis.Result, base: analysis.Result, threshold: float) -> pd.DataFrame:
    con = duckdb.connect(":memory:")
    for prefix, r in (("cur", cur), ("base", base)):
        con.register(f"{prefix}_workloads", r.workloads)
        con.register(f"{prefix}_kernels", r.tables["kernel_summary"])
    return con.execute(sql.text("compare"), {"threshold": threshold}).df()


def outputs(res: analysis.Result, cmp: pd.DataFrame | None, fails: list[str]) -> dict[str, bytes]:
    files = {f"{name}.csv": report.csv_bytes(df, analysis.COLUMNS[name]) for name, df in res.tables.items()}
    if cmp is not None:
        files["compare.csv"] = report.csv_bytes(cmp, list(cmp.columns))
    files["report.html"] = report.render_html(res, res.tables, cmp, analysis.COLUMNS, fails)
    return files


def run(args: argparse.Namespace) -> int:
    if args.threshold < 0:
        raise UsageError(f"--threshold must be >= 0, got {args.threshold}")
    inputs = [pathlib.Path(i) for i in args.inputs] or [default_input()]
    sources = [resolve(i) for i in inputs]
    # Analyze everything (baseline included) before writing anything: bad input leaves no half report.
    results = [analysis.analyze(s, patterns=args.fused_pattern, ranges=args.ranges) for s in sources]
    base = None
    if args.compare is not None:
        base = analysis.analyze(resolve(args.compare), patterns=args.fused_pattern, ranges=args.ranges)
    rc = EXIT_OK
    for res in results:
        fails = analysis.failures(res) if args.require_fused else []
        cmp = compare_frames(res, base, args.threshold) if base is not None else None
        out = out_dir_for(res.source, args.out, len(results) > 1)
        written = report.write_atomic(out, outputs(res, cmp, fails))
        print(f"{PROG}: wrote {len(written)} files to {out} ({res.seconds:.1f} s)")
        for r in res.workloads.itertuples(index=False):
            print(f"  {r.range}: {r.verdict} ({r.instances} repetitions, {report.fmt_ns(r.mean_proj_gpu_ns)} GPU each)")
        for f in fails:
            print(f"{PROG}: not fused: {f}", file=sys.stderr)
            rc = EXIT_CHECK_FAILED
        if cmp is not None:
            for r in cmp[cmp["regression"]].itertuples(index=False):
                print(f"{PROG}: regression: {r.name}: {r.base_verdict} -> {r.cur_verdict}, "
                      f"delta {r.delta_pct}% (threshold {args.threshold}%)", file=sys.stderr)
                rc = EXIT_CHECK_FAILED
    return rc


def main(argv=None) -> int:
    args = parser().parse_args(argv)  # argparse exits 2 on bad usage, as the contract asks
    try:
        return run(args)
    except (trace_db.TraceError, UsageError) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except trace_db.ExtensionMissing as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return EXIT_BLOCKED


if __name__ == "__main__":
    sys.exit(main())
