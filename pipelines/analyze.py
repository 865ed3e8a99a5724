"""python -m pipelines.analyze: DuckDB SQL over nsys SQLite exports, CSV + HTML reports, fused verdicts.

The numbers equal NVIDIA's own reports for the same file (`nsys stats --report cuda_gpu_kern_sum,nvtx_sum,
nvtx_kern_sum,nvtx_gpu_proj_sum`); the verdicts say, per op call and workload repetition, whether the fused
kernels ran. See docs/trace-schema.md for the export tables read, and queries/ for every question asked.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys

import duckdb
import pandas as pd

from pipelines import analysis, compare, report, trace_db
from rlkernel import textsafe
from rlkernel.cli import EXIT_BLOCKED, EXIT_CHECK_FAILED, EXIT_OK, EXIT_USAGE, CliError, OneLineParser

# rlkernel.cli imports neither torch nor the rest of rlkernel: a bare trace analyzes without torch.
PROG = "pipelines.analyze"
EXAMPLE_DIR = pathlib.Path(__file__).resolve().parent / "example"


class UsageError(Exception):
    pass


# --out names the report folder itself (replaced whole); capture's and the profile suite's --output-dir name a
# parent folder. An --output-dir alias would give one flag two meanings: a wrong flag is answered instead.
_OUT_HINT = ("did you mean --out? it names the report folder itself, replaced whole; capture's and the "
             "profile suite's --output-dir name a parent folder")


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        hints={f: _OUT_HINT for f in ("--output-dir", "--outdir", "--out-dir", "--output", "--output-directory")},
        prog="python -m pipelines.analyze",
        description="Analyze nsys SQLite exports with DuckDB: kernel and NVTX-range summaries equal to nsys stats, "
                    "fused/native/fallback verdicts per op call and workload repetition, CSV + one HTML report.",
        epilog="With no INPUT: the newest complete run under ./runs, else the example trace bundled with the "
               "package. Outputs: kernel_summary.csv, range_summary.csv, range_kernels.csv, dispatch.csv, "
               "gaps.csv and utilization.csv (as nsys analyze's gpu_gaps and gpu_time_util), repetition_gaps.csv, "
               "bandwidth.csv (when the manifest gives bytes), compare.csv and compare.json (with --compare), "
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
                   help="kernel-name glob proving the fused path, added to the registry's and the manifest's "
                        "(default when none: rlkernel_*); matched against the short and the demangled name")
    p.add_argument("--range", metavar="NAME", action="append", default=[], dest="ranges",
                   help="also judge this NVTX range as a workload (`domain:name`, `:name` for the default "
                        "domain, or the bare name in any domain)")
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
    p.add_argument("--threshold", metavar="PCT", type=float, default=5.0,
                   help="--compare: percent slower that counts as a regression (default 5)")
    p.add_argument("--force", action="store_true",
                   help="--compare: write the comparison even when the runs are not comparable (another GPU model, "
                        "other workloads or shapes, another kernel set), marked as not comparable; without it such "
                        "a comparison exits 2 saying why")
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


def _status(run: pathlib.Path) -> str | None:
    try:
        data = json.loads((run / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    return data.get("status") if isinstance(data, dict) else None


def newest_run(root: pathlib.Path) -> pathlib.Path | None:
    """The newest complete run directory: its manifest says ``status: complete`` and it holds a trace (names
    start with a UTC timestamp, so they sort by time; a failed run, ``-failed`` or ``-failed.2``, never counts)."""
    if not root.is_dir():
        return None
    runs = [d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".") and
            (d / "trace.sqlite").is_file() and _status(d) == "complete"]
    return max(runs, key=lambda d: d.name, default=None)


def read_json(path: pathlib.Path, what: str):
    try:
        return json.loads(path.read_text())
    # JSONDecodeError and UnicodeDecodeError are ValueErrors; nesting deeper than the parser's stack
    # (`[` x 200000) is a RecursionError
    except (OSError, ValueError, RecursionError) as e:
        why = str(e).splitlines()[0][:160] if not isinstance(e, RecursionError) else "nested too deeply"
        raise trace_db.TraceError(f"{path}: not a readable JSON {what} ({why})") from None


_INT_MAX = 2 ** 63 - 1  # the bytes/flops columns are BIGINT
_KIND_NAMES = {str: "a string", list: "a list", dict: "an object"}


def manifest_problem(data) -> str | None:
    """What makes ``data`` not a run manifest the analyzer can read (docs/contracts.md, section 6), or None.

    Only the fields the analyzer reads are checked, and only their shape: every later ``.get`` and ``int`` on
    a manifest can then trust it."""
    if not isinstance(data, dict):
        return f"a JSON {type(data).__name__}, not an object"
    if data.get("schema", 1) != 1:
        return f"schema {data.get('schema')!r}, this analyzer reads schema 1"
    if not isinstance(data.get("workloads", []), list):
        return "workloads is not a list"
    for i, w in enumerate(data.get("workloads", [])):
        if not isinstance(w, dict):
            return f"workloads[{i}] is not an object"
        if not isinstance(w.get("name"), str) or not w["name"]:
            return f"workloads[{i}] has no name"
        for key in ("fused_ops", "fused_patterns"):
            v = w.get(key, [])
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                return f"workloads[{i}].{key} is not a list of strings"
        if not isinstance(w.get("path", ""), str):
            return f"workloads[{i}].path is not a string"
        for key in ("bytes", "flops"):
            v = w.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= _INT_MAX):
                return f"workloads[{i}].{key} is {v!r}, not a non-negative integer"
    if not isinstance(data.get("dispatch", []), list):
        return "dispatch is not a list"
    for i, r in enumerate(data.get("dispatch", [])):
        if not isinstance(r, dict) or not isinstance(r.get("op"), str) or not isinstance(r.get("status"), str):
            return f"dispatch[{i}] is not a record with op and status strings"
    for key, kind in (("status", str), ("created_at", str), ("command", list), ("node", dict), ("tools", dict),
                      ("env", dict)):
        if data.get(key) is not None and not isinstance(data[key], kind):
            return f"{key} is not {_KIND_NAMES[kind]}"
    devices = (data.get("node") or {}).get("devices") or []
    if not isinstance(devices, list) or not all(
            isinstance(d, dict) and isinstance(d.get("index", -1), int) for d in devices):
        return "node.devices is not a list of records with an integer index"
    ext = (data.get("node") or {}).get("extension")
    if ext is not None and not (isinstance(ext, dict) and isinstance(ext.get("archs") or [], list)
                                and all(isinstance(a, str) for a in ext.get("archs") or [])):
        return "node.extension is not a record with a list of arch strings"
    return None


def read_manifest(path: pathlib.Path) -> dict:
    """The run's manifest, its shape checked once here; a TraceError naming the file otherwise."""
    data = read_json(path, "manifest")
    problem = manifest_problem(data)
    if problem:
        raise trace_db.TraceError(f"{path}: not a run manifest ({problem})")
    return data


def read_provenance(path: pathlib.Path) -> dict:
    data = read_json(path, "provenance record")
    if not isinstance(data, dict):
        raise trace_db.TraceError(f"{path}: not a provenance record (a JSON {type(data).__name__}, not an object)")
    return data


def resolve(inp: pathlib.Path) -> analysis.Source:
    """An INPUT -> what to analyze. Raises TraceError naming the file and the problem."""
    try:
        return _resolve(inp)
    except OSError as e:  # a name longer than the file system takes (ENAMETOOLONG), a directory we cannot search
        raise trace_db.TraceError(f"{inp}: cannot read it ({e.strerror or e})") from None


def _resolve(inp: pathlib.Path) -> analysis.Source:
    if inp.is_dir():
        trace = inp / "trace.sqlite"
        manifest = read_manifest(inp / "manifest.json") if (inp / "manifest.json").is_file() else None
        if not trace.is_file():
            why = f" (the capture failed: {manifest.get('error')})" if manifest and manifest.get("status") == "failed" \
                else ""
            raise trace_db.TraceError(f"{inp}: run directory without a trace (no trace.sqlite){why}")
        prov = None
        if (inp / "recorded.json").is_file():
            prov = read_provenance(inp / "recorded.json")
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


# What DuckDB raises when a trace's numbers do not fit the analysis' 64-bit arithmetic (timestamps at the int64
# extremes: a subtraction, a negation or a sum overflows): bad input, one line naming the file.
NUMERIC_ERRORS = (duckdb.OutOfRangeException, duckdb.ConversionException)


def _out_of_range(path: pathlib.Path, e: Exception) -> trace_db.TraceError:
    return trace_db.TraceError(f"{path}: values out of range for 64-bit arithmetic, not a trace nsys writes "
                               f"({trace_db.first_line(e)})")


def analyze_source(src: analysis.Source, args: argparse.Namespace) -> analysis.Result:
    try:
        return analysis.analyze(src, patterns=args.fused_pattern, ranges=args.ranges)
    except NUMERIC_ERRORS as e:
        raise _out_of_range(src.trace, e) from None


def compare_frames(cur: analysis.Result, base: analysis.Result, threshold: float) -> pd.DataFrame:
    try:
        return compare.frame(cur, base, threshold)
    except NUMERIC_ERRORS as e:
        raise _out_of_range(base.source.trace, e) from None


def outputs(res: analysis.Result, cmp: pd.DataFrame | None, fails: list[str],
            cmp_meta: dict | None = None) -> dict[str, bytes]:
    files = {f"{name}.csv": report.csv_bytes(df, analysis.COLUMNS[name]) for name, df in res.tables.items()}
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
            report.check_target(out)
        except report.OutputError as e:
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


def check_ranges(names: list[str], results: list[analysis.Result]) -> None:
    """Every --range NAME matches a range of some input (`domain:name`, `:name`, or the bare message, as
    analysis.workload_specs matches them); else a usage error naming the closest range names."""
    import difflib

    ranges = sorted({r for res in results for r in res.tables["range_summary"]["range"]})
    for name in names:
        if any(r == name or r.endswith(":" + name) for r in ranges):
            continue
        if not ranges:
            raise UsageError(f"--range {name}: the input{'s have' if len(results) > 1 else ' has'} no NVTX ranges")
        messages = sorted({r.split(":", 1)[1] for r in ranges} | set(ranges))
        close = difflib.get_close_matches(name, messages, n=3, cutoff=0.5)
        hint = f"closest: {', '.join(close)}" if close else \
            f"its ranges include {', '.join(ranges[:3])}{', ...' if len(ranges) > 3 else ''}"
        raise UsageError(f"--range {name}: no such range in {'any input' if len(results) > 1 else 'the input'}; "
                         f"{hint}")


def run(args: argparse.Namespace) -> int:
    if not math.isfinite(args.threshold) or args.threshold < 0:
        raise UsageError(f"--threshold must be a finite number >= 0, got {args.threshold}")
    if args.ranks is not None or args.executor != "local" or args.jobs is not None:
        return run_ranks(args)
    inputs = [pathlib.Path(i) for i in args.inputs] or [default_input()]
    sources = [resolve(i) for i in inputs]
    base_src = resolve(args.compare) if args.compare is not None else None
    outs = [out_dir_for(s, args.out, len(sources) > 1) for s in sources]
    check_outputs(outs)
    # Analyze everything (baseline included) before writing anything: bad input leaves no half report.
    results = [analyze_source(s, args) for s in sources]
    check_ranges(args.ranges, results)
    base = analyze_source(base_src, args) if base_src is not None else None
    metas = [None] * len(results)
    if base is not None:
        metas = [comparison_meta(res, inp, base, args) for res, inp in zip(results, inputs, strict=True)]
    compares = [compare_frames(res, base, args.threshold) if base is not None else None for res in results]
    rc = EXIT_OK
    for res, out, cmp, meta in zip(results, outs, compares, metas, strict=True):
        fails = analysis.failures(res) if args.require_fused else []
        syncs = analysis.sync_failures(res) if args.require_no_sync else []
        try:
            written = report.replace_dir(out, outputs(res, cmp, fails + [f"host sync: {f}" for f in syncs], meta),
                                         on_wait=lambda out=out: say(
                                             f"{PROG}: waiting for another run writing beside {out}", sys.stderr))
        except report.OutputError as e:
            raise UsageError(str(e)) from None
        say(f"{PROG}: wrote {len(written)} files to {out} ({res.seconds:.1f} s)")
        for r in res.workloads.itertuples(index=False):
            say(f"  {r.range}: {r.verdict} ({r.instances} repetitions, {report.fmt_ns(r.mean_gpu_busy_ns)} GPU busy "
                "each)")
        for f in fails:
            say(f"{PROG}: not fused: {f}", sys.stderr)
            rc = EXIT_CHECK_FAILED
        for f in syncs:
            say(f"{PROG}: host sync: {f}", sys.stderr)
            rc = EXIT_CHECK_FAILED
        if cmp is not None:
            for r in cmp[cmp["regression"]].itertuples(index=False):
                say(f"{PROG}: regression: {r.name}: {r.base_verdict} -> {r.cur_verdict}, median "
                    f"{report.fmt_ns(r.base_med_ns)} -> {report.fmt_ns(r.cur_med_ns)} GPU busy per repetition "
                    f"({r.base_instances} -> {r.cur_instances} repetitions), delta {r.delta_pct}% "
                    f"(threshold {args.threshold}%)", sys.stderr)
                rc = EXIT_CHECK_FAILED
    return rc


def run_ranks(args: argparse.Namespace) -> int:
    """--ranks DIR (pipelines.cross_rank): the ranks mapped over a pool or a Dask cluster, one cross-rank report."""
    from pipelines import cross_rank, ranks

    if args.ranks is None:
        raise UsageError("--executor and --jobs go with --ranks DIR")
    if args.inputs or args.compare is not None:
        raise UsageError("--ranks DIR takes no INPUT and no --compare: it analyses the ranks in DIR together")
    if args.jobs is not None and args.jobs < 1:
        raise UsageError(f"--jobs must be at least 1, got {args.jobs}")
    try:
        return cross_rank.run(args)
    except ranks.RanksError as e:
        raise UsageError(str(e)) from None
    except ranks.ExecutorUnavailable as e:
        raise trace_db.ExtensionMissing(str(e)) from None


def say(line: str, file=None) -> None:
    """Print one line with the names in it escaped for the terminal (a range or kernel name can hold ESC,
    NUL or newlines: rlkernel.textsafe.terminal)."""
    print(textsafe.terminal(line), file=file or sys.stdout, flush=True)


def verdict(argv) -> tuple[int, str]:
    """The analyzer run as ``main`` runs it (reports written, the lines of its checks printed), returning its exit
    code and, for a 2 or 3, the one-line reason instead of printing it ("" otherwise): what a caller that judges a
    run (``pipelines.capture --require-fused``) reads, rather than scraping stderr."""
    try:
        args = parser().parse_args(argv)  # bad usage: CliError, one line and exit 2 (not argparse's usage block)
        return run(args), ""
    except CliError as e:
        return e.code, str(e)
    except (trace_db.TraceError, UsageError) as e:
        return EXIT_USAGE, str(e)
    except trace_db.ExtensionMissing as e:
        return EXIT_BLOCKED, str(e)


def main(argv=None) -> int:
    rc, why = verdict(argv)
    if why:
        say(f"{PROG}: {why}", sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
