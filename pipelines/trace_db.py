"""An nsys SQLite export, opened read-only in DuckDB through DuckDB's sqlite extension.

The extension is loaded by path from the PyPI package ``duckdb-extension-sqlite-scanner`` (which must have the
same version as ``duckdb``): there is no network on the GPU nodes, and DuckDB's auto-install is switched off so
that a missing extension is a clear error, not a download attempt.

Every table and column the analyzer reads is listed in :data:`SCHEMA` (and, for people, in
``docs/trace-schema.md``). The export has no indexes and leaves out tables that would have no rows, and older
exports lack some columns: each listed table is copied into a DuckDB temp table ``src_<table>`` with exactly the
listed columns, NULL where the export lacks a column, empty where it lacks the table. The copy reads only the
listed columns (the scanner pushes the projection down), which is what keeps a 1M-launch trace fast.
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import tempfile

import duckdb

# table -> {column: DuckDB type}. `required` tables make a file an nsys export; the others are optional.
SCHEMA: dict[str, dict[str, str]] = {
    "StringIds": {"id": "BIGINT", "value": "VARCHAR"},
    "CUPTI_ACTIVITY_KIND_KERNEL": {
        "start": "BIGINT", "end": "BIGINT", "deviceId": "BIGINT", "streamId": "BIGINT", "correlationId": "BIGINT",
        "globalPid": "BIGINT", "demangledName": "BIGINT", "shortName": "BIGINT", "graphNodeId": "BIGINT"},
    "CUPTI_ACTIVITY_KIND_MEMCPY": {
        "start": "BIGINT", "end": "BIGINT", "deviceId": "BIGINT", "streamId": "BIGINT", "correlationId": "BIGINT",
        "globalPid": "BIGINT", "bytes": "BIGINT", "copyKind": "BIGINT", "srcKind": "BIGINT", "dstKind": "BIGINT",
        "srcDeviceId": "BIGINT", "dstDeviceId": "BIGINT", "graphNodeId": "BIGINT"},
    "CUPTI_ACTIVITY_KIND_MEMSET": {
        "start": "BIGINT", "end": "BIGINT", "deviceId": "BIGINT", "streamId": "BIGINT", "correlationId": "BIGINT",
        "globalPid": "BIGINT", "bytes": "BIGINT", "memKind": "BIGINT", "graphNodeId": "BIGINT"},
    "CUPTI_ACTIVITY_KIND_RUNTIME": {
        "start": "BIGINT", "end": "BIGINT", "globalTid": "BIGINT", "correlationId": "BIGINT", "nameId": "BIGINT"},
    "NVTX_EVENTS": {
        "start": "BIGINT", "end": "BIGINT", "eventType": "BIGINT", "text": "VARCHAR", "textId": "BIGINT",
        "globalTid": "BIGINT", "endGlobalTid": "BIGINT", "domainId": "BIGINT", "int64Value": "BIGINT"},
    "TARGET_INFO_GPU": {
        "id": "BIGINT", "name": "VARCHAR", "busLocation": "VARCHAR", "totalMemory": "BIGINT",
        "memoryBandwidth": "BIGINT", "smCount": "BIGINT", "computeMajor": "BIGINT", "computeMinor": "BIGINT",
        "clockRate": "BIGINT"},
    "META_DATA_EXPORT": {"name": "VARCHAR", "value": "VARCHAR"},
    # the UTC time (ns since the epoch) of the session's time zero: places ranks' traces on one host clock
    "TARGET_INFO_SESSION_START_TIME": {"utcEpochNs": "BIGINT", "utcTime": "VARCHAR"},
}
REQUIRED = ("StringIds",)
# An nsys export always carries one of these; a plain SQLite database carries neither.
NSYS_MARKERS = ("META_DATA_EXPORT", "TARGET_INFO_SESSION_START_TIME")
# META_DATA_EXPORT rows the report may show: never paths, never the host.
EXPORT_META_SHOWN = ("EXPORT_PRODUCT_NAME", "EXPORT_PRODUCT_VERSION", "EXPORT_SCHEMA_VERSION", "EXPORT_TIME_UTC")

SQLITE_MAGIC = b"SQLite format 3\x00"


class TraceError(Exception):
    """Bad input: the message names the file and the problem (exit 2)."""


class SettingError(TraceError):
    """A bad RLKERNEL_ANALYZE_* environment value (exit 2, as bad input): the message names the variable."""


MEMORY_ENV = "RLKERNEL_ANALYZE_MEMORY"  # DuckDB's memory_limit for each connection (default 2GB)


class ExtensionMissing(Exception):
    """This machine lacks the sqlite extension package (exit 3)."""


def extension_path() -> pathlib.Path:
    version = duckdb.__version__
    hint = f"pip install duckdb-extension-sqlite-scanner=={version}"
    spec = importlib.util.find_spec("duckdb_extension_sqlite_scanner")
    if spec is None or not spec.submodule_search_locations:
        raise ExtensionMissing(f"DuckDB's sqlite extension is not installed: {hint}")
    root = pathlib.Path(list(spec.submodule_search_locations)[0])
    found = sorted(root.glob(f"extensions/v{version}/*.duckdb_extension"))
    if not found:
        have = sorted(p.parent.name for p in root.glob("extensions/*/*.duckdb_extension"))
        raise ExtensionMissing(f"duckdb-extension-sqlite-scanner has no build for duckdb {version} "
                               f"(it has {', '.join(have) or 'none'}): {hint}")
    return found[0]


def connect(threads: int | None = None, memory_limit: str | None = None) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with the sqlite extension loaded; no extension is ever downloaded."""
    cfg = {"autoinstall_known_extensions": False, "autoload_known_extensions": False}
    # Threads: the CPUs this process may run on (taskset), not the machine's count.
    cfg["threads"] = threads or max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    # 2GB: a 1M-kernel trace then peaks at 2.33 GB RSS in 12.7 s on 2 cores (3GB: 3.53 GB; docs/benchmarks.md)
    from_env = memory_limit is None and MEMORY_ENV in os.environ
    cfg["memory_limit"] = memory_limit or os.environ.get(MEMORY_ENV, "2GB")
    try:
        con = duckdb.connect(":memory:", config=cfg)
    except duckdb.Error as e:
        if not from_env:
            raise
        # DuckDB's ParserException (a traceback) for foo, 100% or an empty value: a usage error, one line
        raise SettingError(f"{MEMORY_ENV}={cfg['memory_limit']!r}: not a memory size (give one such as 2GB, 512MB "
                           f"or 1.5GiB; {first_line(e)})") from None
    path = extension_path()
    # LOAD takes no prepared parameter; the path is this package's own file, never user input.
    con.execute(f"LOAD '{path.as_posix()}'")
    return con


def check_sqlite_file(path: pathlib.Path) -> None:
    """Reject what is not a whole SQLite file before DuckDB sees it: clearer messages than the scanner's."""
    if not path.exists():
        raise TraceError(f"{path}: no such file")
    if not path.is_file():
        raise TraceError(f"{path}: not a file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(100)
    if len(head) < 100 or head[:16] != SQLITE_MAGIC:
        raise TraceError(f"{path}: not an SQLite database (an nsys export is made with `nsys export --type sqlite`)")
    page = int.from_bytes(head[16:18], "big")
    page = 65536 if page == 1 else page
    pages = int.from_bytes(head[28:32], "big")
    # The header's page count is valid when its "version-valid-for" equals the change counter.
    if head[24:28] == head[92:96] and pages and size < page * pages:
        raise TraceError(f"{path}: truncated SQLite file ({size} bytes, its header says {page * pages})")


def wal_mode(path: pathlib.Path) -> bool:
    """The file's header says WAL journal mode (write/read format versions 2)."""
    with open(path, "rb") as f:
        head = f.read(20)
    return head[18:20] != b"\x01\x01"


class Trace:
    """One export loaded into DuckDB temp tables ``src_<table>``; ``tables`` says which were present.
    ``scan`` is the file actually scanned (a private copy of a WAL-mode export), ``path`` the one named."""

    def __init__(self, con: duckdb.DuckDBPyConnection, path: pathlib.Path, scan: pathlib.Path | None = None):
        self.con = con
        self.path = path
        self.scan = scan or path
        self.tables: set[str] = set()
        self.load()

    def load(self) -> None:
        p = str(self.scan)
        try:
            present = {r[0] for r in self.con.execute(
                "SELECT name FROM sqlite_scan(?, 'sqlite_master') WHERE type = 'table'", [p]).fetchall()}
        except duckdb.Error as e:
            raise TraceError(f"{self.path}: cannot read as SQLite ({first_line(e)})") from None
        missing = [t for t in REQUIRED if t not in present]
        if missing or not any(m in present for m in NSYS_MARKERS):
            raise TraceError(f"{self.path}: not an nsys export (no {', '.join(missing or NSYS_MARKERS)} table)")
        for table, cols in SCHEMA.items():
            self._copy(table, cols, table in present)
        # every name join (kernel, range, domain) matches one row per id: a repeated id would multiply instances
        dup = self.con.execute("SELECT id, count(*) FROM src_StringIds WHERE id IS NOT NULL GROUP BY id "
                               "HAVING count(*) > 1 ORDER BY id LIMIT 1").fetchone()
        if dup is not None:
            raise TraceError(f"{self.path}: StringIds holds id {dup[0]} more than once ({dup[1]} rows), not an "
                             "export nsys writes (its id is the table's primary key)")

    def _copy(self, table: str, cols: dict[str, str], present: bool) -> None:
        p = str(self.scan)
        have: set[str] = set()
        if present:
            try:
                have = {r[0] for r in self.con.execute(f"DESCRIBE SELECT * FROM sqlite_scan(?, '{table}')", [p])
                        .fetchall()}
            except duckdb.Error as e:
                raise TraceError(f"{self.path}: table {table} unreadable ({first_line(e)})") from None
        select = ", ".join(f'CAST("{c}" AS {t}) AS "{c}"' if c in have else f'CAST(NULL AS {t}) AS "{c}"'
                           for c, t in cols.items())
        # Table and column names come from SCHEMA above (constants), the path is a bound parameter.
        source = f"sqlite_scan(?, '{table}')" if present else "(SELECT 1) AS absent WHERE false"
        sql = f"CREATE OR REPLACE TEMP TABLE src_{table} AS SELECT {select} FROM {source}"
        try:
            self.con.execute(sql, [p] if present else [])
        except duckdb.Error as e:
            raise TraceError(f"{self.path}: table {table} unreadable ({first_line(e)})") from None
        except UnicodeDecodeError:
            # A BLOB that is not UTF-8 in a text column: the scanner's own error message carries the raw bytes,
            # which the Python binding cannot decode. Invalid bytes stored as TEXT get the scanner's error.
            raise TraceError(f"{self.path}: table {table} unreadable (a text value that is not UTF-8)") from None
        if present:
            self.tables.add(table)

    def meta(self) -> dict:
        """What the report may say about where and when the trace was made (never paths or environment)."""
        rows = self.con.execute("SELECT name, value FROM src_META_DATA_EXPORT").fetchall()
        meta = {k: v for k, v in rows if k in EXPORT_META_SHOWN}
        gpus = self.con.execute(
            "SELECT id, name, computeMajor, computeMinor, smCount, totalMemory, memoryBandwidth, clockRate "
            "FROM src_TARGET_INFO_GPU ORDER BY id").fetchall()
        meta["gpus"] = [dict(zip(("id", "name", "cc_major", "cc_minor", "sm_count", "memory_bytes",
                                  "memory_bandwidth_bytes_per_s", "clock_rate"), g, strict=True)) for g in gpus]
        return meta


def empty_sources(con: duckdb.DuckDBPyConnection) -> None:
    """Create every ``src_<table>`` empty, with SCHEMA's columns (what an export without the table gives)."""
    for table, cols in SCHEMA.items():
        body = ", ".join(f'"{c}" {t}' for c, t in cols.items())
        con.execute(f"CREATE OR REPLACE TEMP TABLE src_{table} ({body})")


def first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__


# What DuckDB raises when a trace's numbers do not fit the analysis' 64-bit arithmetic (timestamps at the int64
# extremes: a subtraction, a negation or a sum overflows): bad input, one line naming the file.
NUMERIC_ERRORS = (duckdb.OutOfRangeException, duckdb.ConversionException)


def out_of_range(path: pathlib.Path, e: Exception) -> TraceError:
    """The TraceError for one of NUMERIC_ERRORS raised while analysing ``path``."""
    return TraceError(f"{path}: values out of range for 64-bit arithmetic, not a trace nsys writes ({first_line(e)})")


def open_trace(path: pathlib.Path, con: duckdb.DuckDBPyConnection | None = None) -> Trace:
    path = pathlib.Path(path)
    check_sqlite_file(path)
    if not wal_mode(path):
        return Trace(con or connect(), path)
    # SQLite opens a WAL-mode database, even read-only, by creating <file>-wal and <file>-shm beside it (and fails
    # where that directory is read-only), and the scanner takes no `immutable` URI. Scan a private copy instead,
    # with its -wal when one lies beside it (rows not yet checkpointed live there); the tables are copied into
    # DuckDB on load, so the copy goes right after. nsys itself never writes WAL-mode exports.
    with tempfile.TemporaryDirectory(prefix="rlkernel-wal-") as d:
        copy = pathlib.Path(d) / "trace.sqlite"
        try:
            shutil.copyfile(path, copy)
            wal = path.with_name(path.name + "-wal")
            if wal.is_file():
                shutil.copyfile(wal, copy.with_name(copy.name + "-wal"))
        except OSError as e:
            raise TraceError(f"{path}: a WAL-mode SQLite file, and copying it to read it failed "
                             f"({e.strerror or e})") from None
        return Trace(con or connect(), path, scan=copy)
