"""A stand-in for nsys in the CPU tests of ``pipelines.capture`` (nsys cannot run here: the one edge replaced).

``install(bin_dir)`` puts an ``nsys`` on a folder to prepend to PATH. As nsys does, ``nsys profile ... -o BASE
--force-overwrite true CMD ...`` runs CMD (its output through, its exit code returned, a SIGTERM or SIGINT passed
on to it) and writes ``BASE.nsys-rep``; ``nsys export --type sqlite ... --output OUT REP`` writes an SQLite file in
the export's schema (docs/trace-schema.md). With ``FAKE_NSYS_NVTX_LIB`` (tests/nvtx_log.py's library) the command
and its children run under that NVTX tool, and the export holds their NVTX ranges as nsys writes them (registered
strings in ``StringIds``, one domain-create event per process and domain, push/pop ranges with their int64
payload). Besides, each profile writes ``BASE.fake.json``: its arguments and the variables capture sets.

Knobs (environment): FAKE_NSYS_FAIL (profile exits 1 before running anything), FAKE_NSYS_NO_REP (profile runs the
command, writes no report), FAKE_NSYS_EXPORT_FAIL (export exits 1).
"""
from __future__ import annotations

import json
import os
import pathlib
import signal
import sqlite3
import stat
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
VERSION = "NVIDIA Nsight Systems version 2099.1.1.1-fake"


def install(bin_dir: pathlib.Path) -> pathlib.Path:
    bin_dir.mkdir(parents=True, exist_ok=True)
    exe = bin_dir / "nsys"
    exe.write_text(f"#!/bin/sh\nexec '{sys.executable}' '{pathlib.Path(__file__).resolve()}' \"$@\"\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return bin_dir


def profile(a: list[str]) -> int:
    i = a.index("--force-overwrite")
    opts, cmd = a[:i], a[i + 2:]
    base = opts[opts.index("-o") + 1]
    seen = {k: os.environ.get(k) for k in ("RLKERNEL_CAPTURE_STEPS", "PYTHONPATH")}
    pathlib.Path(base + ".fake.json").write_text(json.dumps({"argv": a, "env": seen, "pid": os.getpid()}))
    if os.environ.get("FAKE_NSYS_FAIL"):
        print("fake nsys: injected failure", file=sys.stderr)
        return 1
    env = dict(os.environ)
    if os.environ.get("FAKE_NSYS_NVTX_LIB"):
        env.update(NVTX_INJECTION64_PATH=os.environ["FAKE_NSYS_NVTX_LIB"], NVTX_LOG_FILE=base + ".nvtx.log")
    proc = subprocess.Popen(cmd, env=env)
    for s in (signal.SIGTERM, signal.SIGINT):  # nsys ends the session on these: the application gets them too
        signal.signal(s, lambda signum, frame: proc.send_signal(signum))
    rc = proc.wait()
    if not os.environ.get("FAKE_NSYS_NO_REP"):
        pathlib.Path(base + ".nsys-rep").write_text(base + ".nvtx.log")
    return rc if rc >= 0 else 128 - rc


def export(a: list[str]) -> int:
    if os.environ.get("FAKE_NSYS_EXPORT_FAIL"):
        print("fake nsys: injected export failure", file=sys.stderr)
        return 1
    out, rep = a[a.index("--output") + 1], a[-1]
    log = pathlib.Path(pathlib.Path(rep).read_text().strip())
    sys.path.insert(0, str(ROOT))
    from tests import nvtx_log

    con = sqlite3.connect(out)
    con.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL)")
    con.execute("CREATE TABLE META_DATA_EXPORT (name TEXT, value TEXT)")
    con.execute("INSERT INTO META_DATA_EXPORT VALUES ('EXPORT_PRODUCT_NAME', 'fake nsys')")
    con.execute("CREATE TABLE TARGET_INFO_SESSION_START_TIME (utcEpochNs INTEGER, utcTime TEXT)")
    con.execute("INSERT INTO TARGET_INFO_SESSION_START_TIME VALUES (1767225600000000000, '2026-01-01T00:00:00Z')")
    ranges = nvtx_log.ranges(log) if log.name and log.exists() else []
    if ranges:
        con.execute("CREATE TABLE NVTX_EVENTS (start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL, "
                    "rangeId INTEGER, category INTEGER, color INTEGER, text TEXT, globalTid INTEGER, "
                    "endGlobalTid INTEGER, textId INTEGER, domainId INTEGER, uint64Value INTEGER, "
                    "int64Value INTEGER, doubleValue REAL, uint32Value INTEGER, int32Value INTEGER, "
                    "floatValue REAL, jsonTextId INTEGER, jsonText TEXT, binaryData TEXT)")
        strings: dict[str, int] = {}
        domains: dict[tuple[int, str], int] = {}
        t0 = min(r.start for r in ranges)

        def string_id(text: str) -> int:
            if text not in strings:
                strings[text] = len(strings) + 1
                con.execute("INSERT INTO StringIds VALUES (?, ?)", (strings[text], text))
            return strings[text]

        for r in ranges:
            tid = (r.pid << 24) | (r.tid & 0xFFFFFF)
            key = (r.pid, r.domain)
            if key not in domains:  # ids are per process, as nsys numbers them
                domains[key] = 1 + sum(1 for p, _ in domains if p == r.pid)
                con.execute("INSERT INTO NVTX_EVENTS (start, eventType, text, globalTid, domainId) "
                            "VALUES (?, 75, ?, ?, ?)", (r.start - t0, r.domain, tid, domains[key]))
            con.execute("INSERT INTO NVTX_EVENTS (start, end, eventType, globalTid, textId, domainId, int64Value) "
                        "VALUES (?, ?, 59, ?, ?, ?, ?)",
                        (r.start - t0, r.end - t0, tid, string_id(r.message), domains[key], r.payload))
    con.commit()
    con.close()
    return 0


def main(a: list[str]) -> int:
    if a == ["--version"]:
        print(VERSION)
        return 0
    if a and a[0] == "profile":
        return profile(a[1:])
    if a and a[0] == "export":
        return export(a[1:])
    print(f"fake nsys: unsupported {a[:1]}", file=sys.stderr)
    return 9


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
