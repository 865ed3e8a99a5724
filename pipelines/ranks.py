"""`analyze --ranks DIR`, the map side: which ranks a folder holds, one rank's analysis as Parquet partials, and
the executors that map it over the ranks (a local process pool, or a Dask cluster).

A rank is one export, or one process of a multi-process export. Its analysis is today's single-trace analysis
(``analysis.analyze``, a pure function from one export to tables, the RL-step view's steps and phases included)
plus one question of its own
(``queries/cross_rank_partial.sql``); what travels back is its tables as Parquet files (DuckDB's
``COPY ... (FORMAT parquet)``) and a small record, never the export. pipelines.cross_rank reduces them.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import multiprocessing
import os
import pathlib
import re
import signal
import socket
import sys
import tempfile
import threading
import time

import duckdb
import pandas as pd

from pipelines import analysis, inputs, sql, trace_db
from pipelines.manifest import read_manifest  # the one manifest reader (its shape checks)
from rlkernel.cli import INT64_MAX

WHOLE_TRACE = "(whole trace)"
COMM_PATTERNS = ("nccl*",)
# `nsys -o rank%q{RANK}` and capture --ranks (trace_rank<N>.sqlite) both put `rank<N>` in the name
_RANK_RE = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)
_PID_MASK = 0xFFFFFF  # globalPid >> 24 keeps the hardware/VM ids above the pid's 24 bits
CONNECT_TIMEOUT_S = 20  # how long --executor dask:// waits for the scheduler to answer
HANDSHAKE_TIMEOUT_S = 5  # a Dask server sends its handshake as it accepts; a silent port gets this long
WORKER_WAIT_S = 5  # a scheduler with no workers gets this long for one to join, then exit 3
_HANDSHAKE_MAX = 1 << 20  # a Dask handshake is a few hundred bytes; b"HTTP/1.1" read as its length is 3.5e18


class RanksError(Exception):
    """Bad --ranks input (exit 2); the message names the path."""


@dataclasses.dataclass(frozen=True)
class RankSpec:
    """One rank: the export (and its run directory's Source), and, for a multi-process export, the process."""

    rank: int
    source: analysis.Source
    label: str  # the entry of DIR it came from, as the report names it
    proc: int | None = None  # globalPid >> 24 of the process kept; None: the whole export
    device: int | None = None


@dataclasses.dataclass(frozen=True)
class RankJob:
    spec: RankSpec
    patterns: tuple[str, ...] = ()
    ranges: tuple[str, ...] = ()
    comm_patterns: tuple[str, ...] = COMM_PATTERNS
    threads: int | None = None  # DuckDB threads; None: the CPUs this process may use
    # the RL-step view (--phase, --step-range; the rlkernel domain's phase ranges anyway): each rank's steps and
    # phases tables travel back with the others; a name this rank lacks is no error here (checked on the union)
    phases: tuple[str, ...] | None = ()  # None: no view (--no-step-view)
    step_range: str | None = None


@dataclasses.dataclass
class RankPartial:
    """What one rank's analysis sends back: table name -> Parquet bytes, and its record."""

    rank: int
    parquet: dict[str, bytes]
    info: dict


# ---------------------------------------------------------------------------------------------------------- discovery

def _entries(folder: pathlib.Path) -> list[pathlib.Path]:
    """The exports of ``folder``: its ``*.sqlite`` files and its run directories (holding trace.sqlite)."""
    try:
        items = sorted(folder.iterdir(), key=lambda p: p.name)
    except OSError as e:
        raise RanksError(f"{folder}: cannot read it ({e.strerror or e})") from None
    for p in items:
        # a link whose target is gone may have been a rank: dropping it would pass --require-fused without it
        if not p.name.startswith(".") and p.is_symlink() and not p.exists():
            raise RanksError(f"{p}: a dangling symlink (its target {os.readlink(p)} does not exist); it may be a "
                             "rank: restore its target or remove the link")
    return [p for p in items if not p.name.startswith(".") and
            ((p.is_file() and p.suffix == ".sqlite") or (p.is_dir() and (p / "trace.sqlite").is_file()))]


def rank_numbers(names: list[str]) -> list[int]:
    """The rank of each name: its ``rank<N>`` when every name has one and they differ, else the sorted order."""
    found = [_RANK_RE.search(n) for n in names]
    if all(found):
        nums = [int(m.group(1)) for m in found]
        for n, k in zip(names, nums, strict=True):
            if k > INT64_MAX:  # pandas would hold it as a float: 1e+20 in the CSVs, and every other rank 0.0
                raise RanksError(f"{n}: rank {k} does not fit a 64-bit integer")
        if len(set(nums)) == len(nums):
            return nums
        dup = sorted({n for n in nums if nums.count(n) > 1})[0]
        both = ", ".join(n for n, k in zip(names, nums, strict=True) if k == dup)
        raise RanksError(f"two exports name rank {dup} ({both})")
    order = sorted(range(len(names)), key=lambda i: names[i])
    return [order.index(i) for i in range(len(names))]


def cuda_processes(trace: pathlib.Path) -> list[tuple[int, int]]:
    """(device id, proc) of every process with GPU work in the export, in rank order (device, then pid).
    A launcher process (torchrun's agent, a multiprocessing parent) has none and is left out."""
    trace_db.check_sqlite_file(trace)
    con = trace_db.connect(threads=1)
    p = str(trace)
    try:
        present = {r[0] for r in con.execute(
            "SELECT name FROM sqlite_scan(?, 'sqlite_master') WHERE type = 'table'", [p]).fetchall()}
        parts = [f"SELECT deviceId, globalPid >> 24 AS proc FROM sqlite_scan(?, '{t}')"  # t: a constant below
                 for t in ("CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET")
                 if t in present]
        union = " UNION ALL ".join(parts)
        rows = con.execute(f"SELECT min(deviceId), proc FROM ({union}) GROUP BY proc",
                           [p] * len(parts)).fetchall() if parts else []
        nulls = con.execute(f"SELECT count(*) FILTER (WHERE proc IS NULL), count(*) FILTER (WHERE deviceId IS NULL) "
                            f"FROM ({union})", [p] * len(parts)).fetchone() if parts else (0, 0)
    except duckdb.Error as e:
        raise trace_db.TraceError(f"{trace}: cannot read as SQLite ({trace_db.first_line(e)})") from None
    finally:
        con.close()
    for n, col in zip(nulls, ("globalPid", "deviceId"), strict=True):
        if n:  # nsys writes both for every GPU operation; without them no process or device owns the operation
            raise trace_db.TraceError(f"{trace}: {n} GPU operations with a NULL {col}, not an export nsys writes "
                                      "(the split by process needs it)")
    return sorted((int(d), int(proc)) for d, proc in rows)


def discover(path: pathlib.Path) -> list[RankSpec]:
    """The ranks of ``path``: a folder of per-rank exports or run directories (one rank each), or one export
    (a file, a run directory, or a folder holding one) split by process. Each entry becomes an analysis.Source
    as a single INPUT does (inputs.resolve: the run directory's manifest and provenance come along)."""
    # absolute: a Dask worker reads the exports from another working directory
    path = pathlib.Path(os.path.abspath(path))
    if not path.exists():
        raise RanksError(f"{path}: no such file or directory")
    if path.is_file() or (path / "trace.sqlite").is_file():
        entries, shared = [path], None
    else:
        entries = _entries(path)
        # capture --ranks: trace_rank<N>.sqlite files beside one shared manifest
        shared = path / "manifest.json" if (path / "manifest.json").is_file() else None
    if not entries:
        raise RanksError(f"{path}: no exports in it (*.sqlite files or run directories holding trace.sqlite)")
    sources = [inputs.resolve(e) for e in entries]
    if shared is not None:
        manifest = read_manifest(shared)
        sources = [s if s.manifest else dataclasses.replace(s, manifest=manifest) for s in sources]
    if len(entries) == 1:
        procs = cuda_processes(sources[0].trace)
        if len(procs) > 1:
            return [RankSpec(i, sources[0], f"{entries[0].name} pid {proc & _PID_MASK}", proc, dev)
                    for i, (dev, proc) in enumerate(procs)]
    nums = rank_numbers([e.name for e in entries])
    specs = [RankSpec(n, s, e.name) for n, s, e in zip(nums, sources, entries, strict=True)]
    return sorted(specs, key=lambda s: s.rank)


# --------------------------------------------------------------------------------------------------------- map step

def keep_process(proc: int):
    """A ``prepare`` hook for analysis.analyze: drop every other process's rows from the loaded tables."""
    def prepare(con) -> None:
        for table, col in (("CUPTI_ACTIVITY_KIND_KERNEL", "globalPid"), ("CUPTI_ACTIVITY_KIND_MEMCPY", "globalPid"),
                           ("CUPTI_ACTIVITY_KIND_MEMSET", "globalPid"), ("CUPTI_ACTIVITY_KIND_RUNTIME", "globalTid"),
                           ("NVTX_EVENTS", "globalTid")):
            con.execute(f'DELETE FROM src_{table} WHERE "{col}" >> 24 IS DISTINCT FROM ?', [proc])
    return prepare


def _copy_parquet(con, df: pd.DataFrame, rank: int, path: pathlib.Path) -> None:
    d = df.copy()
    d.insert(0, "rank", rank)
    d["_row"] = range(len(d))  # the single-trace order, kept through the union
    con.register("partial_df", d)
    # the path is a temporary file of ours; COPY takes no prepared parameter for it
    con.execute(f"COPY (SELECT * FROM partial_df) TO '{path.as_posix()}' (FORMAT parquet)")
    con.unregister("partial_df")


def analyze_rank(job: RankJob) -> RankPartial:
    """One rank -> its tables as Parquet bytes. Runs in a pool process or on a Dask worker: everything it needs
    is in ``job`` (picklable), and it reads the export from the path there."""
    spec = job.spec
    con = trace_db.connect(threads=job.threads)
    prepare = keep_process(spec.proc) if spec.proc is not None else None
    try:
        res = analysis.analyze(spec.source, patterns=list(job.patterns), ranges=list(job.ranges), con=con,
                               prepare=prepare,
                               phases=list(job.phases) if job.phases is not None else None, step_range=job.step_range,
                               strict_phases=False)
        con.execute("SET enable_progress_bar = false")  # a pool's bars would interleave on stderr
        # kept in DuckDB, not pandas: an all-NULL verdict column keeps its VARCHAR type in the Parquet file
        con.execute("CREATE OR REPLACE TEMP TABLE rank_partial AS " + sql.text("cross_rank_partial"),
                    {"comm_patterns": list(job.comm_patterns)})
    except trace_db.NUMERIC_ERRORS as e:
        raise trace_db.out_of_range(spec.source.trace, e) from None
    start = con.execute("SELECT min(utcEpochNs) FROM src_TARGET_INFO_SESSION_START_TIME").fetchone()[0]
    frames = dict(res.tables, workloads=res.workloads)
    out: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory(prefix="rlkernel-rank-") as d:
        for name, df in frames.items():
            path = pathlib.Path(d) / f"{name}.parquet"
            _copy_parquet(con, df, spec.rank, path)
            out[name] = path.read_bytes()
        path = pathlib.Path(d) / "cross_rank.parquet"
        con.execute(f"COPY (SELECT {int(spec.rank)} AS rank, *, 0 AS _row FROM rank_partial) "
                    f"TO '{path.as_posix()}' (FORMAT parquet)")
        out["cross_rank"] = path.read_bytes()
        rows = {name: len(df) for name, df in frames.items()}
        rows["cross_rank"] = con.execute("SELECT count(*) FROM rank_partial").fetchone()[0]
    con.close()
    info = {"rank": spec.rank, "source": spec.label, "trace": str(spec.source.trace),
            "pid": spec.proc & _PID_MASK if spec.proc is not None else None, "device": spec.device,
            "session_start_ns": int(start) if start is not None else None, "counts": dict(res.counts),
            "patterns": list(res.patterns), "failures": analysis.failures(res),
            "sync_failures": analysis.sync_failures(res), "meta": res.meta,
            "rows": rows, "seconds": res.seconds,
            "headline": res.phase_view.headline if res.phase_view is not None else ""}
    return RankPartial(spec.rank, out, info)


# -------------------------------------------------------------------------------------------------------- executors

def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def run_local(jobs: list[RankJob], workers: int | None = None) -> list[RankPartial]:
    """The ranks on a process pool of this machine: min(cores, ranks) processes, the cores shared out as DuckDB
    threads. One worker runs them in this process, one after the other."""
    n = max(1, min(workers or cpu_count(), len(jobs)))
    threads = max(1, cpu_count() // n)
    jobs = [dataclasses.replace(j, threads=threads) for j in jobs]
    if n == 1:
        return [analyze_rank(j) for j in jobs]
    # spawn, not fork: DuckDB's threads in this process must not be copied mid-state into the children
    with concurrent.futures.ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"),
                                                initializer=pool_worker_init, initargs=(os.getpid(),)) as pool:
        return list(pool.map(analyze_rank, jobs))


def pool_worker_init(parent: int) -> None:
    """A pool worker's initializer: Ctrl-C (sent to the whole process group) ends it at once with no traceback of
    its own (SIGINT's default action; the parent says it in one line), and it dies with its parent."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    die_with_parent(parent)


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent: int) -> None:
    """A pool worker's initializer: end this process when ``parent`` dies. A worker of a parent killed with -9
    otherwise waits forever on the job queue, whose write end it holds itself (and keeps the resource tracker
    alive through its pipe). On Linux the kernel sends SIGKILL (prctl PR_SET_PDEATHSIG); elsewhere a thread
    polls the parent's pid. A parent gone before this ran is caught by the check after it. (The kernel signals
    when the *thread* that started the worker ends: a spawn-context ProcessPoolExecutor starts its workers in
    submit(), so in run_local's own thread, which outlives them.)"""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            _poll_parent(parent)
    else:
        _poll_parent(parent)
    if os.getppid() != parent:
        os._exit(1)


def _poll_parent(parent: int) -> None:
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)
    threading.Thread(target=watch, name="rlkernel-parent-watch", daemon=True).start()


class ExecutorUnavailable(Exception):
    """The executor cannot run here (exit 3): dask not installed, the scheduler not reachable."""


def run_dask(address: str, jobs: list[RankJob]) -> list[RankPartial]:
    """The same function mapped over the ranks on an existing Dask cluster (``dask://HOST:PORT`` -> the scheduler
    at tcp://HOST:PORT). The workers read the exports from the same paths (a file system they share); only the
    partials travel back."""
    try:
        from distributed import Client
    except ImportError:
        raise ExecutorUnavailable("--executor dask://: dask.distributed is not installed "
                                  "(pip install 'rlkernel[dask]')") from None
    target = "tcp://" + address
    probe_scheduler(address)
    try:
        client = Client(target, timeout=f"{CONNECT_TIMEOUT_S}s")
    except (OSError, TimeoutError) as e:
        raise ExecutorUnavailable(f"--executor dask://{address}: no scheduler answers there ({e})") from None
    with client:
        try:
            # a scheduler with no workers would take the jobs and wait for a worker forever, saying nothing
            client.wait_for_workers(1, timeout=WORKER_WAIT_S)
        except TimeoutError:
            raise ExecutorUnavailable(f"--executor dask://{address}: the scheduler has no workers (none joined in "
                                      f"{WORKER_WAIT_S} s); start some with `dask worker tcp://{address}`") from None
        futures = client.map(analyze_rank, jobs, pure=False)
        return client.gather(futures)


def probe_scheduler(address: str) -> None:
    """ExecutorUnavailable unless something at ``address`` speaks first as a Dask server does: on accepting a
    connection it writes its handshake, a message that starts with its length (8 bytes, little-endian). Checked
    on a plain socket before Client() because Client waits on a silent port past its connect timeout, and reads
    an HTTP reply's bytes as a length of exabytes (a MemoryError)."""
    host, port = address.rsplit(":", 1)
    host = host.strip("[]")
    where = f"--executor dask://{address}"
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            sock = socket.create_connection((host, int(port)), timeout=max(0.1, deadline - time.monotonic()))
            break
        except OSError as e:
            # a refused connection is retried until the deadline, as Client does: a scheduler may be starting
            if isinstance(e, ConnectionRefusedError) and time.monotonic() + 0.5 < deadline:
                time.sleep(0.5)
                continue
            raise ExecutorUnavailable(f"{where}: no scheduler answers there ({e.strerror or e})") from None
    with sock:
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        head = b""
        try:
            while len(head) < 8:
                got = sock.recv(8 - len(head))
                if not got:
                    break
                head += got
        except OSError:  # socket.timeout included
            pass
    if len(head) < 8:
        raise ExecutorUnavailable(f"{where}: the port accepts connections but does not speak Dask's protocol "
                                  f"(no handshake in {HANDSHAKE_TIMEOUT_S} s); is it a Dask scheduler's address?")
    size = int.from_bytes(head, "little")
    if size > _HANDSHAKE_MAX:
        raise ExecutorUnavailable(f"{where}: not a Dask scheduler (its first bytes {head!r} are no Dask "
                                  "handshake)")


# HOST: a name or IPv4 address (letters, digits, '.', '-', '_') or a bracketed IPv6 address; PORT: 1-65535
_HOST_PORT_RE = re.compile(r"(?P<host>[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\]):(?P<port>[0-9]{1,5})")


def executor_address(value: str) -> str | None:
    """``local`` -> None; ``dask://HOST:PORT`` -> ``HOST:PORT``; anything else: RanksError, at once (a port out of
    range or a missing one would otherwise wait out the connect timeout, a second scheme give a traceback)."""
    if value == "local":
        return None
    if not value.startswith("dask://"):
        raise RanksError(f"--executor {value}: give local or dask://HOST:PORT")
    address = value[len("dask://"):]
    m = _HOST_PORT_RE.fullmatch(address)
    if m is None or not 1 <= int(m.group("port")) <= 65535:
        raise RanksError(f"--executor {value}: not an address of the form dask://HOST:PORT "
                         "(a host name or IP address, and a port 1-65535)")
    return address


def run_jobs(jobs: list[RankJob], executor: str, workers: int | None) -> list[RankPartial]:
    address = executor_address(executor)
    return run_local(jobs, workers) if address is None else run_dask(address, jobs)
