"""analyze --ranks at scale: K ranks of about N kernels each, replicated from a committed export.

    python benchmarks/bench_ranks.py [--source tests/data/zero_sync/trace.sqlite] [--kernels 1000000]
                                     [--ranks 8] [--work /tmp/bench-ranks]

The export's GPU operations, launch calls and NVTX events are repeated back to back in time (each copy shifted by
the trace's length, its correlation ids by their largest) until it holds at least N kernels; the copy is then the
trace of every rank. T1 is one rank's time with one DuckDB thread (`taskset -c 0`, `--ranks` of one rank); the
memory baseline is one rank on every core this process may use, where the K ranks run too. Wall time and peak
memory are measured around the whole command; the memory is summed over the process tree (RSS of every
descendant, sampled every 50 ms).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import resource
import shutil
import sqlite3
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
TABLES = ("CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET",
          "CUPTI_ACTIVITY_KIND_RUNTIME", "NVTX_EVENTS")


def replicate(src: pathlib.Path, dst: pathlib.Path, kernels: int) -> int:
    shutil.copy(src, dst)
    con = sqlite3.connect(dst)
    present = [t for t in TABLES if con.execute("SELECT 1 FROM sqlite_master WHERE name = ?", (t,)).fetchone()]
    lo = min(con.execute(f"SELECT min(start) FROM {t}").fetchone()[0] for t in present)
    hi = max(con.execute(f'SELECT max(coalesce("end", start)) FROM {t}').fetchone()[0] for t in present)
    shift = hi - lo + 1000
    corr = max(con.execute(f"SELECT coalesce(max(correlationId), 0) FROM {t}").fetchone()[0]
               for t in present if t != "NVTX_EVENTS") + 1
    base = con.execute("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL").fetchone()[0]
    copies = -(-kernels // base)
    for t in present:
        cols = [r[1] for r in con.execute(f"PRAGMA table_info({t})")]
        n0 = con.execute(f"SELECT max(rowid) FROM {t}").fetchone()[0]
        sel = ", ".join(f'"{c}" + :s' if c in ("start", "end") else f'"{c}" + :c' if c == "correlationId"
                        else "NULL" if c == "id" else f'"{c}"' for c in cols)
        for i in range(1, copies):
            con.execute(f"INSERT INTO {t} ({', '.join(chr(34) + c + chr(34) for c in cols)}) "
                        f"SELECT {sel} FROM {t} WHERE rowid <= :n0", {"s": i * shift, "c": i * corr, "n0": n0})
    con.commit()
    total = con.execute("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL").fetchone()[0]
    con.close()
    return total


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and every descendant (from /proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            total += int(open(f"/proc/{p}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            pass
    return total


def measure(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds and peak tree memory; prints the CPU seconds the tree used and the load average, since on a
    shared machine another job's load stretches the wall time."""
    t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_rss(proc.pid))
        time.sleep(0.05)
    if proc.returncode != 0:
        sys.exit(f"bench_ranks: {' '.join(cmd)} exited {proc.returncode}")
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    print(f"  cpu {cpu:.2f} s, load average after {os.getloadavg()[0]:.2f}", flush=True)
    return wall, peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", type=pathlib.Path, default=ROOT / "tests/data/zero_sync/trace.sqlite")
    p.add_argument("--kernels", type=int, default=1_000_000)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--work", type=pathlib.Path, default=pathlib.Path("/tmp/bench-ranks"))
    a = p.parse_args()
    if not a.source.is_file():
        p.error(f"--source {a.source}: no such file")
    if a.kernels < 1 or a.ranks < 1:
        p.error("--kernels and --ranks must be >= 1")
    if a.work.exists() and not a.work.is_dir():
        p.error(f"--work {a.work}: not a directory")
    one, many = a.work / "one", a.work / "many"
    for d in (one, many):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    t0 = time.perf_counter()
    n = replicate(a.source, one / "trace_rank0.sqlite", a.kernels)
    for r in range(a.ranks):
        os.link(one / "trace_rank0.sqlite", many / f"trace_rank{r}.sqlite")
    print(f"replicated {a.source.name} to {n:,} kernels in {time.perf_counter() - t0:.1f} s, "
          f"{(one / 'trace_rank0.sqlite').stat().st_size / 1e6:.0f} MB", flush=True)
    analyze = [sys.executable, "-m", "pipelines.analyze", "--ranks"]
    t1, p1 = measure(["taskset", "-c", "0", *analyze, str(one), "--out", str(a.work / "out-one")])
    print(f"T1 (one rank, one DuckDB thread): {t1:.2f} s, peak {p1 / 2**20:.0f} MiB (process tree)", flush=True)
    cores = len(os.sched_getaffinity(0))
    # the memory baseline is one rank on the same cores as the K ranks (its DuckDB uses them all)
    w1, m1 = measure([*analyze, str(one), "--out", str(a.work / "out-one")])
    print(f"one rank on {cores} cores: {w1:.2f} s, peak {m1 / 2**20:.0f} MiB (process tree)", flush=True)
    tk, mk = measure([*analyze, str(many), "--out", str(a.work / "out-many")])
    bound = 1.2 * a.ranks * t1 / min(cores, a.ranks)
    print(f"{a.ranks} ranks on {cores} cores: {tk:.2f} s (target <= {bound:.2f} s: "
          f"{'met' if tk <= bound else 'missed'}), peak {mk / 2**20:.0f} MiB "
          f"(target <= {2 * m1 / 2**20:.0f} MiB: {'met' if mk <= 2 * m1 else 'missed'})", flush=True)


if __name__ == "__main__":
    main()
