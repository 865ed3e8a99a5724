"""Strip an nsys SQLite export for use as a committed fixture: `strip_export.py SRC DST`.

Removes the traced process's environment (TARGET_INFO_SYSTEM_ENV and the
PROCESS_<n>:ENVIRONMENT_VARIABLE rows of META_DATA_CAPTURE, which can hold tokens),
replaces absolute paths, the home directory and the host name in every text column, and VACUUMs
the result into DST. SRC is not modified.
"""
from __future__ import annotations

import os
import pathlib
import socket
import sqlite3
import sys


def scrub_pairs(extra: list[str]) -> list[tuple[str, str]]:
    pairs = [(p, "<path>") for p in extra if p and len(p) > 1]
    home = os.path.expanduser("~")
    if home not in ("/", ""):
        pairs.append((home, "~"))
    host = socket.gethostname()
    if host:
        pairs.append((host, "<host>"))
    # Longest first, so a path is replaced before a prefix of it.
    return sorted(set(pairs), key=lambda kv: -len(kv[0]))


def strip(src: str, dst: str, extra_paths: list[str]) -> None:
    dst_p = pathlib.Path(dst)
    if dst_p.exists():
        dst_p.unlink()
    con = sqlite3.connect(src)
    con.execute(f"VACUUM INTO '{dst_p}'")  # a copy; the source export stays as nsys wrote it
    con.close()
    con = sqlite3.connect(dst)
    tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")]
    if "TARGET_INFO_SYSTEM_ENV" in tables:
        con.execute("DELETE FROM TARGET_INFO_SYSTEM_ENV")
    if "META_DATA_CAPTURE" in tables:  # nsys 2025.3 also keeps the launched process's whole environment here
        con.execute("DELETE FROM META_DATA_CAPTURE WHERE name LIKE '%ENVIRONMENT_VARIABLE%'")
    if "META_DATA_CAPTURE" in tables:
        con.execute("DELETE FROM META_DATA_CAPTURE WHERE name LIKE '%ENVIRONMENT%'")
    if "StringIds" in tables:  # the environment's NAME=value strings also sit in the string table: blank them
        con.execute("UPDATE StringIds SET value = '' WHERE value GLOB '[A-Za-z_]*=*' "
                    "AND substr(value, 1, instr(value, '=') - 1) NOT GLOB '*[^A-Za-z0-9_]*'")
    pairs = scrub_pairs(extra_paths)
    for t in tables:
        cols = [r[1] for r in con.execute(f'PRAGMA table_info("{t}")') if (r[2] or "").upper() == "TEXT"]
        for c in cols:
            for old, new in pairs:
                con.execute(f'UPDATE "{t}" SET "{c}" = replace("{c}", ?, ?) WHERE instr("{c}", ?) > 0',
                            (old, new, old))
    con.commit()
    con.execute("VACUUM")
    con.close()


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit("usage: strip_export.py SRC DST [PATH_TO_SCRUB ...]")
    strip(sys.argv[1], sys.argv[2], [os.getcwd(), os.path.dirname(os.path.abspath(sys.argv[1]))] + sys.argv[3:])
