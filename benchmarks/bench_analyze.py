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
                                       [--variants pushpop,startend,mixed] [--phase-steps N] [--workdir DIR] [--keep]
    python benchmarks/bench_analyze.py --export TRACE.sqlite[.xz] [--limit 10]

``--phase-steps N`` analyzes each variant's trace again with RL phases added (add_phases: N rlkernel steps per
thread, each holding rollout, loss, policy_forward and optimizer over the launches), once with ``--no-step-view``
and once with the view: the difference is what the RL-step view (docs/contracts.md, section 11) costs, the first
run's excess over the plain trace what the phase ranges themselves cost (staged like any range). ``--export``
times the analyzer on one given export instead,
e.g. the 2-step TRL trace of tools/rl_step_walkthrough.sh (issue 35's target: <= 10 s on 2 cores; run it under
``taskset -c 0,1``).

Writes nothing under the repository; the traces live in --workdir (default: a temporary directory, removed
unless --keep). Exit 1 when the two variants' CSVs differ.
"""
from __future__ import annotations

import lzma
import math
import os
import pathlib
import re
import shutil
import sqlite3
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
    counts["layout"] = {"t0": int(t0), "span": int(span), "reps": int(reps), "pid": int(pid), "threads": threads,
                        "sid": int(sid) + 2}
    return counts


PHASES = (("rollout", 0.0, 0.6), ("loss", 0.6, 0.9), ("optimizer", 0.9, 1.0))  # shares of a step's repetitions


def add_phases(src: pathlib.Path, dst: pathlib.Path, layout: dict, steps: int) -> int:
    """A copy of ``src`` with RL phases (docs/contracts.md, section 11) over its launches: on every thread,
    ``steps`` rlkernel.step() ranges (domain ``rlkernel``, ``phase:step``, payload the step index), each holding
    rollout, loss (holding policy_forward) and optimizer over its first 60 %, next 30 % and last 10 % of that
    thread's repetitions. Every boundary falls in the 1 ms gap between two repetitions, so the ranges nest with
    the benchmark's own. Returns the number of range rows added."""
    shutil.copyfile(src, dst)
    t0, span, reps, pid, threads, sid = (layout[k] for k in ("t0", "span", "reps", "pid", "threads", "sid"))
    names = ["rlkernel", "phase:step", *(f"phase:{n}" for n, _, _ in PHASES), "phase:policy_forward"]
    ids = {n: sid + i for i, n in enumerate(names)}
    rows = []  # (start, end, eventType, globalTid, textId, domainId, int64Value)

    def at(rep: int, offset: int) -> int:  # a point in the gap before repetition `rep` (offset < 0) or after it
        return t0 + rep * span + (offset if offset < 0 else span - offset)

    for t in range(threads):
        tid = pid | (1000 + t)
        mine = list(range(t, reps, threads))
        rows.append((t0, None, 75, tid, ids["rlkernel"], 2, None))
        per = -(-len(mine) // steps)
        for k, first in enumerate(range(0, len(mine), per)):
            chunk = mine[first:first + per]
            rows.append((at(chunk[0], -500_000), at(chunk[-1], 500_000), 59, tid, ids["phase:step"], 2, k))
            for name, a, b in PHASES:
                part = chunk[int(a * len(chunk)):max(int(b * len(chunk)), int(a * len(chunk)) + 1)]
                if not part:
                    continue
                rows.append((at(part[0], -400_000), at(part[-1], 600_000), 59, tid, ids[f"phase:{name}"], 2, None))
                if name == "loss":  # the training forward, inside loss: its first half
                    half = part[:max(1, len(part) // 2)]
                    rows.append((at(half[0], -300_000), at(half[-1], 700_000), 59, tid,
                                 ids["phase:policy_forward"], 2, None))
    con = sqlite3.connect(dst)
    try:
        con.executemany("INSERT INTO StringIds (id, value) VALUES (?, ?)", [(i, n) for n, i in ids.items()])
        if "int64Value" not in {r[1] for r in con.execute("PRAGMA table_info(NVTX_EVENTS)")}:
            con.execute("ALTER TABLE NVTX_EVENTS ADD COLUMN int64Value INTEGER")  # the step index's payload
        con.executemany("INSERT INTO NVTX_EVENTS (start, \"end\", eventType, globalTid, endGlobalTid, textId, "
                        "domainId, int64Value) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        [(*r[:4], r[3], *r[4:]) for r in rows])
        con.commit()
    finally:
        con.close()
    return len(rows)


def analyze(trace: pathlib.Path, out: pathlib.Path, *extra: str) -> tuple[float, float, float, str, str]:
    """Wall seconds, CPU seconds (user + system), peak RSS in GB (this child alone: wait4's rusage), stderr and
    stdout of one analyzer run. CPU time is the steadier figure on a shared machine."""
    cmd = [sys.executable, "-m", "pipelines.analyze", str(trace), "--out", str(out), *extra]
    with tempfile.TemporaryFile("w+") as err, tempfile.TemporaryFile("w+") as said:
        t = time.perf_counter()
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=said, stderr=err, text=True)
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t
        p.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        said.seek(0)
        log, stdout = err.read(), said.read()
    if p.returncode not in (0, 1):
        raise RuntimeError(f"analyzer exit {p.returncode}: {log.strip()[-500:]}")
    return wall, ru.ru_utime + ru.ru_stime, ru.ru_maxrss / 1e6, log, stdout


def headline(stdout: str) -> str:
    """The RL-step headline the analyzer printed ("GPU busy ..."), or ""."""
    return next((ln.strip() for ln in stdout.splitlines() if ln.startswith("  GPU busy ")), "")


def unpack(src: pathlib.Path, work: pathlib.Path) -> pathlib.Path:
    """An export as given (.sqlite) or xz-compressed (.sqlite.xz, tools/rl_step_walkthrough.sh's), as a file in
    ``work``."""
    if src.suffix != ".xz":
        return src
    dst = work / src.stem
    with lzma.open(src, "rb") as f, open(dst, "wb") as g:
        shutil.copyfileobj(f, g, 1 << 22)
    return dst


def time_export(src: pathlib.Path, work: pathlib.Path, limit: float | None) -> int:
    """--export: the analyzer timed on one given export (the 2-step TRL trace of issue 35's target)."""
    t = time.perf_counter()
    trace = unpack(src, work)
    unpacked = time.perf_counter() - t
    trace_db.check_sqlite_file(trace)
    con = sqlite3.connect(f"file:{trace}?mode=ro", uri=True)
    try:
        kernels = con.execute("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL").fetchone()[0]
    finally:
        con.close()
    wall, cpu, rss, _, stdout = analyze(trace, work / "export-out")
    print(f"  {src.name}: {kernels:,} kernels ({trace.stat().st_size / 2**20:.0f} MiB, unpacked in {unpacked:.1f} s): "
          f"analyze {wall:.2f} s wall, {cpu:.1f} s CPU, {rss:.2f} GB peak RSS", flush=True)
    print(f"  headline: {headline(stdout) or '(none: no steps in the trace)'}")
    if limit is not None:
        print(f"  target <= {limit:g} s wall: {'met' if wall <= limit else 'NOT met'}")
        return 0 if wall <= limit else 1
    return 0


def same_but_style(a: pathlib.Path, b: pathlib.Path) -> list[str]:
    """Names of the CSVs that differ between two output directories, the `style` column left out."""
    bad = []
    for name in COMPARED:
        x, y = (pd.read_csv(d / f"{name}.csv", keep_default_na=False) for d in (a, b))
        x, y = (f.drop(columns=[c for c in ("style",) if c in f.columns]) for f in (x, y))
        if not x.equals(y):
            bad.append(name)
    return bad


def _is_sqlite(path: pathlib.Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(16) == b"SQLite format 3\x00"
    except OSError:
        return False


def _existing_parent(path: pathlib.Path) -> pathlib.Path:
    return next(p for p in path.absolute().parents if p.exists())


def main(argv=None) -> int:
    ap = OneLineParser(prog="bench_analyze", description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", type=int, default=1_000_000)
    ap.add_argument("--ranges-per-launch", type=int, default=2)
    ap.add_argument("--threads", type=int, default=5)
    ap.add_argument("--variants", default="pushpop,startend,mixed")
    ap.add_argument("--fixture", type=pathlib.Path, default=FIXTURE)
    ap.add_argument("--workdir", type=pathlib.Path)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--phase-steps", type=int, default=0, metavar="N",
                    help="also analyze each variant with N rlkernel steps of RL phases per thread added (the same "
                         "trace otherwise): what the RL-step view adds")
    ap.add_argument("--repeat", type=int, default=1, metavar="R",
                    help="--phase-steps: analyze the phased trace R times with and without the view, alternating, "
                         "and compare the least times")
    ap.add_argument("--export", type=pathlib.Path, metavar="FILE",
                    help="time the analyzer on this export instead (.sqlite, or .sqlite.xz as "
                         "tools/rl_step_walkthrough.sh keeps it); no trace is built")
    ap.add_argument("--limit", type=float, metavar="S", help="--export: exit 1 when the analyzer takes longer")
    try:
        args = ap.parse_args(argv)
        variants = args.variants.split(",")
        if not set(variants) <= set(STYLE) or args.kernels < 1 or args.ranges_per_launch < 1 or args.threads < 1 \
                or args.phase_steps < 0 or args.repeat < 1:
            raise CliError(f"variants are {', '.join(STYLE)}; counts must be >= 1 (--phase-steps >= 0)")
        if args.export is not None and not args.export.is_file():
            raise CliError(f"--export {args.export}: no such file")
        if args.limit is not None and args.export is None:
            raise CliError("--limit goes with --export")
        if args.limit is not None and not (math.isfinite(args.limit) and args.limit > 0):
            raise CliError(f"--limit must be a number of seconds > 0, got {args.limit}")
        if args.export is None and not _is_sqlite(args.fixture):
            raise CliError(f"--fixture {args.fixture}: not an SQLite export (the trace its workload is copied from)")
        if args.workdir is not None and args.workdir.exists() and not args.workdir.is_dir():
            raise CliError(f"--workdir {args.workdir}: not a directory")
        if args.workdir is not None and not os.access(args.workdir if args.workdir.exists() else
                                                      _existing_parent(args.workdir), os.W_OK):
            raise CliError(f"--workdir {args.workdir}: not writable")
    except CliError as exc:
        print(f"bench_analyze: {exc}", file=sys.stderr)
        return exc.code
    work = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="bench_analyze-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.export is not None:
        print(f"bench_analyze: --export {args.export}, {os.cpu_count()} CPUs visible, "
              f"{len(os.sched_getaffinity(0))} usable")
        try:
            return time_export(args.export, work, args.limit)
        except (trace_db.TraceError, lzma.LZMAError, sqlite3.Error) as e:
            print(f"bench_analyze: --export {args.export}: {e}", file=sys.stderr)
            return 2
        finally:
            if not args.keep and args.workdir is None:
                shutil.rmtree(work, ignore_errors=True)
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
            wall, cpu, rss, log, _ = analyze(trace, outs[v])
            staged = [ln for ln in log.splitlines() if "staged" in ln or "analyzed" in ln]
            said = [float(m) for m in re.findall(r"(?:done, |analyzed in )([0-9.]+) s", log)]
            silence = max((b - a for a, b in zip(said, said[1:], strict=False)), default=0.0)
            print(f"  {v:9s} kernels {counts['CUPTI_ACTIVITY_KIND_KERNEL']:,} nvtx rows {counts['NVTX_EVENTS']:,} "
                  f"({trace.stat().st_size / 2**20:.0f} MiB, built in {built:.1f} s): analyze {wall:.2f} s wall, "
                  f"{cpu:.1f} s CPU, "
                  f"{rss:.2f} GB peak RSS, longest silence {silence:.1f} s | "
                  f"{' | '.join(s.split(': ', 2)[-1] for s in staged)}", flush=True)
            if args.phase_steps:
                phased = work / f"{v}-phases.sqlite"
                added = add_phases(trace, phased, counts["layout"], args.phase_steps)
                off, on = work / f"{v}-phases-off", work / f"{v}-phases-out"
                runs = {"off": [], "on": []}
                for _ in range(args.repeat):  # alternating, the least of each: a shared machine's noise
                    runs["off"].append(analyze(phased, off, "--no-step-view"))
                    runs["on"].append(analyze(phased, on))
                (owall, ocpu), (pwall, pcpu) = ((min(r[0] for r in runs[k]), min(r[1] for r in runs[k]))
                                                for k in ("off", "on"))
                n_steps = len(pd.read_csv(on / "steps.csv"))
                print(f"  {v:9s} + RL phases ({added} ranges, {n_steps} steps), least of {args.repeat}: "
                      f"--no-step-view {owall:.2f} s wall, {ocpu:.1f} s CPU ({100 * (ocpu / cpu - 1):+.1f} % CPU over "
                      f"the trace without them: the phase ranges' own cost); with the view {pwall:.2f} s wall, "
                      f"{pcpu:.1f} s CPU: **the view adds {100 * (pcpu / ocpu - 1):+.1f} % CPU, "
                      f"{100 * (pwall / owall - 1):+.1f} % wall** | {headline(runs['on'][-1][4])}", flush=True)
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
