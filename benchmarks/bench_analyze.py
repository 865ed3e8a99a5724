"""The analyzer at scale: builds big nsys exports by replicating a committed fixture, times pipelines.analyze on them.

The fixture's kernels and their launch calls form one block; the block is repeated (times shifted by its span,
correlation ids by the largest id + 1) until there are ``--kernels`` kernels, the repetitions spread round-robin
over ``--threads`` threads of the fixture's process. Every launch call gets ``--ranges-per-launch`` NVTX ranges
of one name around it, nested (50 ns apart), in domain ``bench`` (registered string ``step``); their style is the
variant's: ``pushpop`` (eventType 59), ``startend`` (60, ended on the same thread), ``mixed`` (alternating,
start/end outermost). Each variant is analyzed in its own process (``python -m pipelines.analyze TRACE --out
DIR``), which reports wall time, CPU time, peak RSS (the child's maxrss) and the longest silence between its
progress lines; the CSVs of the pushpop and startend variants must then be equal except for the ``style`` column.

    python benchmarks/bench_analyze.py [--kernels 1000000] [--ranges-per-launch 2] [--threads 5]
                                       [--variants pushpop,startend,mixed] [--workdir DIR] [--keep]

Writes nothing under the repository; the traces live in --workdir (default: a temporary directory, removed
unless --keep). Exit 1 when the two variants' CSVs differ.
"""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

import pandas as pd

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipelines import trace_db  # noqa: E402
from rlkernel.cli import CliError, OneLineParser  # noqa: E402

FIXTURE = ROOT / "tests" / "data" / "verdicts" / "trace.sqlite"
STYLE = {"pushpop": "59", "startend": "60", "mixed": "CASE WHEN lvl % 2 = 0 THEN 60 ELSE 59 END"}
COMPARED = ("kernel_summary", "range_summary", "range_kernels")


def build(fixture: pathlib.Path, out: pathlib.Path, kernels: int, per_launch: int, threads: int,
          variant: str) -> dict:
    """Write the replicated export to ``out``; returns its row counts."""
    out.unlink(missing_ok=True)
    con = trace_db.connect()
    con.execute(f"ATTACH '{fixture.as_posix()}' AS src (TYPE sqlite, READ_ONLY)")
    con.execute(f"ATTACH '{out.as_posix()}' AS dst (TYPE sqlite)")
    # One block: the fixture's kernels with the launch call of each (same process).
    con.execute("""
        CREATE TEMP TABLE block AS
        SELECT k.rowid AS krow, r.rowid AS rrow, k.correlationId, k.globalPid,
               k.start AS k_start, k."end" AS k_end, r.start AS r_start, r."end" AS r_end
        FROM src.CUPTI_ACTIVITY_KIND_KERNEL AS k
        JOIN src.CUPTI_ACTIVITY_KIND_RUNTIME AS r
          ON r.correlationId = k.correlationId AND (r.globalTid >> 24) = (k.globalPid >> 24)""")
    n_block, t0, span, cmax, pid = con.execute("""
        SELECT count(*), least(min(k_start), min(r_start)),
               greatest(max(k_end), max(r_end)) - least(min(k_start), min(r_start)) + 1000000,
               max(correlationId) + 1, any_value(globalPid) FROM block""").fetchone()
    reps = -(-kernels // n_block)
    con.execute("""
        CREATE TEMP TABLE launches AS
        SELECT b.*, (? | (1000 + i % ?)) AS tid, i * ? AS shift, i * ? AS cshift
        FROM block AS b, range(?) AS t(i)
        QUALIFY row_number() OVER (ORDER BY i, b.correlationId) <= ?""", [pid, threads, span, cmax, reps, kernels])
    sid = con.execute("SELECT max(id) + 1 FROM src.StringIds").fetchone()[0]
    con.execute("CREATE TABLE dst.StringIds AS SELECT * FROM src.StringIds UNION ALL "
                "SELECT ?, 'bench' UNION ALL SELECT ?, 'step'", [sid, sid + 1])
    # Kernels and launch calls: the fixture's rows, every column kept (so `nsys stats` reads the result too).
    con.execute("""
        CREATE TABLE dst.CUPTI_ACTIVITY_KIND_KERNEL AS
        SELECT k.* REPLACE (k.start + l.shift AS start, k."end" + l.shift AS "end",
                            k.correlationId + l.cshift AS correlationId)
        FROM launches AS l JOIN src.CUPTI_ACTIVITY_KIND_KERNEL AS k ON k.rowid = l.krow ORDER BY start""")
    con.execute("""
        CREATE TABLE dst.CUPTI_ACTIVITY_KIND_RUNTIME AS
        SELECT r.* REPLACE (r.start + l.shift AS start, r."end" + l.shift AS "end", l.tid AS globalTid,
                            r.correlationId + l.cshift AS correlationId)
        FROM launches AS l JOIN src.CUPTI_ACTIVITY_KIND_RUNTIME AS r ON r.rowid = l.rrow ORDER BY start""")
    # Ranges: level 0 outermost; a domain-create event (eventType 75) per thread names domain 1 `bench`.
    con.execute(f"""
        CREATE TABLE dst.NVTX_EVENTS AS
        SELECT * FROM (
            SELECT ? AS start, NULL::BIGINT AS "end", 75 AS eventType, NULL::BIGINT AS rangeId,
                   NULL::BIGINT AS category, NULL::BIGINT AS color, NULL::VARCHAR AS text, tid AS globalTid,
                   NULL::BIGINT AS endGlobalTid, ? AS textId, 1 AS domainId
            FROM (SELECT DISTINCT tid FROM launches)
            UNION ALL
            SELECT r_start + shift - 50 * (? - lvl), r_end + shift + 50 * (? - lvl), {STYLE[variant]}, NULL, NULL,
                   NULL, NULL, tid, tid, ?, 1
            FROM launches, range(?) AS l(lvl)
        ) ORDER BY start""", [t0, sid, per_launch, per_launch, sid + 1, per_launch])
    # Every other table of the fixture as it is (GPU, export metadata, enums, processes).
    made = {"StringIds", "CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_RUNTIME", "NVTX_EVENTS"}
    others = [r[0] for r in con.execute("SELECT name FROM sqlite_scan(?, 'sqlite_master') WHERE type = 'table'",
                                        [str(fixture)]).fetchall() if r[0] not in made]
    for t in others:
        con.execute(f'CREATE TABLE dst."{t}" AS SELECT * FROM src."{t}"')
    counts = {t: con.execute(f"SELECT count(*) FROM dst.{t}").fetchone()[0]
              for t in ("CUPTI_ACTIVITY_KIND_KERNEL", "NVTX_EVENTS")}
    con.close()
    return counts


def analyze(trace: pathlib.Path, out: pathlib.Path) -> tuple[float, float, float, str]:
    """Wall seconds, CPU seconds (user + system), peak RSS in GB (this child alone: wait4's rusage) and stderr
    of one analyzer run. CPU time is the steadier figure on a shared machine."""
    cmd = [sys.executable, "-m", "pipelines.analyze", str(trace), "--out", str(out)]
    with tempfile.TemporaryFile("w+") as err:
        t = time.perf_counter()
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, text=True)
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t
        p.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        log = err.read()
    if p.returncode not in (0, 1):
        raise RuntimeError(f"analyzer exit {p.returncode}: {log.strip()[-500:]}")
    return wall, ru.ru_utime + ru.ru_stime, ru.ru_maxrss / 1e6, log


def same_but_style(a: pathlib.Path, b: pathlib.Path) -> list[str]:
    """Names of the CSVs that differ between two output directories, the `style` column left out."""
    bad = []
    for name in COMPARED:
        x, y = (pd.read_csv(d / f"{name}.csv", keep_default_na=False) for d in (a, b))
        x, y = (f.drop(columns=[c for c in ("style",) if c in f.columns]) for f in (x, y))
        if not x.equals(y):
            bad.append(name)
    return bad


def main(argv=None) -> int:
    ap = OneLineParser(prog="bench_analyze", description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", type=int, default=1_000_000)
    ap.add_argument("--ranges-per-launch", type=int, default=2)
    ap.add_argument("--threads", type=int, default=5)
    ap.add_argument("--variants", default="pushpop,startend,mixed")
    ap.add_argument("--fixture", type=pathlib.Path, default=FIXTURE)
    ap.add_argument("--workdir", type=pathlib.Path)
    ap.add_argument("--keep", action="store_true")
    try:
        args = ap.parse_args(argv)
        variants = args.variants.split(",")
        if not set(variants) <= set(STYLE) or args.kernels < 1 or args.ranges_per_launch < 1 or args.threads < 1:
            raise CliError(f"variants are {', '.join(STYLE)}; counts must be >= 1")
    except CliError as exc:
        print(f"bench_analyze: {exc}", file=sys.stderr)
        return exc.code
    work = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="bench_analyze-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"bench_analyze: {args.kernels} kernels, {args.ranges_per_launch} ranges per launch, {args.threads} "
          f"threads, {os.cpu_count()} CPUs visible, {len(os.sched_getaffinity(0))} usable; fixture {args.fixture.name}")
    outs = {}
    try:
        for v in variants:
            trace = work / f"{v}.sqlite"
            t = time.perf_counter()
            counts = build(args.fixture, trace, args.kernels, args.ranges_per_launch, args.threads, v)
            built = time.perf_counter() - t
            outs[v] = work / f"{v}-out"
            wall, cpu, rss, log = analyze(trace, outs[v])
            staged = [ln for ln in log.splitlines() if "staged" in ln or "analyzed" in ln]
            said = [float(m) for m in re.findall(r"(?:done, |analyzed in )([0-9.]+) s", log)]
            silence = max((b - a for a, b in zip(said, said[1:], strict=False)), default=0.0)
            print(f"  {v:9s} kernels {counts['CUPTI_ACTIVITY_KIND_KERNEL']:,} nvtx rows {counts['NVTX_EVENTS']:,} "
                  f"({trace.stat().st_size / 2**20:.0f} MiB, built in {built:.1f} s): analyze {wall:.2f} s wall, "
                  f"{cpu:.1f} s CPU, "
                  f"{rss:.2f} GB peak RSS, longest silence {silence:.1f} s | "
                  f"{' | '.join(s.split(': ', 2)[-1] for s in staged)}", flush=True)
        rc = 0
        if {"pushpop", "startend"} <= set(outs):
            bad = same_but_style(outs["pushpop"], outs["startend"])
            print(f"  pushpop vs startend CSVs: {'identical except style' if not bad else 'DIFFER: ' + ', '.join(bad)}")
            rc = 1 if bad else 0
        return rc
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
