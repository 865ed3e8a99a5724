"""The RL-step view of one export (the analyzer's phases.csv / steps.csv) against NVIDIA's numbers for the same file.

    python tools/rl_step_compare.py REPORT_DIR NSYS_DIR TRACE.sqlite

REPORT_DIR is `python -m pipelines.analyze TRACE --out REPORT_DIR`'s folder; NSYS_DIR holds `nsys stats`'
stats_<report>.csv (nvtx_sum, nvtx_gpu_proj_sum, nvtx_pushpop_trace) and tools/fixture_rules.sh's
rules_<rule>.csv for TRACE. The check is the tests' own (tests/nsys_reference.py check_against_nvidia: instances,
wall spans, projections, GPU ops, host syncs, step spans, longest gaps); the table printed beside it puts each
phase's numbers next to NVIDIA's, and gpu_time_util's busiest chunk next to the steps' busy share.
Exit 0 equal, 1 a difference (the first one named), 2 bad usage, 3 pandas missing.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import types

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROG = "rl_step_compare.py"


def load(report: pathlib.Path):
    """phases.csv and steps.csv as the analyzer wrote them, in the shape check_against_nvidia reads."""
    import pandas as pd

    tables = {}
    for name in ("phases", "steps"):
        path = report / f"{name}.csv"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file (a trace without rlkernel.phase/step ranges?)")
        tables[name] = pd.read_csv(path) if path.stat().st_size else pd.DataFrame()
    return types.SimpleNamespace(tables=tables)


def table(res, nsys: pathlib.Path) -> list[str]:
    """One line per phase: ours beside nsys stats' (instances, total wall, projection, GPU ops)."""
    from tests.nsys_reference import nvidia

    ssum = nvidia(nsys, "stats_nvtx_sum").set_index("Range")
    proj = nvidia(nsys, "stats_nvtx_gpu_proj_sum")
    proj = proj.set_index("Range") if not proj.empty else proj
    lines = [f"{'phase':<20} {'inst':>9} {'wall ms':>19} {'proj ms':>19} {'GPU ops':>15} {'syncs':>6}  (ours/nsys)"]
    for p in res.tables["phases"].itertuples(index=False):
        n = ssum.loc[p.phase] if p.phase in ssum.index else None
        q = proj.loc[p.phase] if p.phase in proj.index else None
        lines.append(
            f"{p.name:<20} {p.instances:>4}/{n['Instances'] if n is not None else '-':<4} "
            f"{p.total_ns / 1e6:>9.2f}/{n['Total Time (ns)'] / 1e6 if n is not None else 0:<9.2f} "
            f"{p.proj_total_ns / 1e6:>9.3f}/{q['Total Proj Time (ns)'] / 1e6 if q is not None else 0:<9.3f} "
            f"{p.gpu_ops:>7}/{q['Total GPU Ops'] if q is not None else 0:<7} {p.host_syncs:>6}")
    steps = res.tables["steps"]
    if not steps.empty:
        busy = 100.0 * steps["gpu_busy_ns"].sum() / steps["wall_ns"].sum()
        util = nvidia(nsys, "rules_gpu_time_util")
        ref = ""
        if not util.empty:
            col = next((c for c in util.columns if "In-Use" in c or "Util" in c), None)
            ref = f"; gpu_time_util: {len(util)} chunks, busiest {util[col].max()} %" if col else ""
        lines.append(f"steps: {len(steps)}, GPU busy {busy:.3g} % of their wall time{ref}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report", type=pathlib.Path, help="the analyzer's --out folder (phases.csv, steps.csv)")
    ap.add_argument("nsys", type=pathlib.Path, help="the folder of nsys stats' and nsys analyze's CSVs")
    ap.add_argument("trace", type=pathlib.Path, help="the export both read")
    args = ap.parse_args(argv)
    for path in (args.report, args.nsys):
        if not path.is_dir():
            print(f"{PROG}: {path}: not a folder", file=sys.stderr)
            return 2
    if not args.trace.is_file():
        print(f"{PROG}: {args.trace}: no such file", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))  # tests.nsys_reference, from the checkout this script is in
    try:
        from tests.nsys_reference import check_against_nvidia
    except ImportError as e:
        print(f"{PROG}: {e.name} is missing (pip install pandas)", file=sys.stderr)
        return 3
    try:
        res = load(args.report)
        print("\n".join(table(res, args.nsys)))
    except (FileNotFoundError, KeyError) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    try:
        check_against_nvidia(args.nsys, res, args.trace)
    except AssertionError as e:
        print(f"{PROG}: NOT equal to NVIDIA on {args.trace.name}: {e or 'a check failed'}")
        return 1
    print(f"{PROG}: equal to NVIDIA on {args.trace.name} ({len(res.tables['phases'])} phases, "
          f"{len(res.tables['steps'])} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
