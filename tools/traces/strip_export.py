"""Strip an nsys SQLite export, or a run's manifest.json, for use as a committed fixture.

    strip_export.py SRC.sqlite DST.sqlite [PATH_TO_SCRUB ...]
    strip_export.py SRC/manifest.json DST/manifest.json

An export: removes the traced process's environment (TARGET_INFO_SYSTEM_ENV, the PROCESS_<n>:ENVIRONMENT_VARIABLE
rows of META_DATA_CAPTURE, and the NAME=value strings in StringIds, which can hold tokens); replaces every
absolute path token in every text value by ``<path>/<basename>`` (``/opt/torch/.venv/bin/python3`` ->
``<path>/python3``), in every column whatever its declared type; replaces what remains of the given paths, the
home directory and the host name (each as a whole name); and VACUUMs the result into DST. Kernel names and NVTX
messages never start with ``/``, so they stay intact. A manifest: the same path tokens in every string
(command, steps, tools, node), written as JSON. SRC is never modified, and DST must be another file (copy a
committed fixture to a temporary file first).
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import socket
import sqlite3
import sys

try:
    from rlkernel.textsafe import scrub_paths
except ImportError:  # run as a script from a checkout: the repository root is two levels up
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
    from rlkernel.textsafe import scrub_paths


def scrub_pairs(extra: list[str]) -> list[tuple[re.Pattern, str]]:
    """(pattern, replacement) for the given paths, the home directory and the host name, each matched as a
    whole (a path not followed by more of a name, the host as a word: a host "vm" leaves "nvml" alone)."""
    pairs = [(p.rstrip("/"), "<path>") for p in extra if p and len(p.rstrip("/")) > 1]
    home = os.path.expanduser("~").rstrip("/")
    if home:
        pairs.append((home, "~"))
    out = [(re.compile(re.escape(p) + r"(?![\w.-])"), new) for p, new in pairs]
    host = socket.gethostname()
    if host:
        out.append((re.compile(r"(?<![\w.-])" + re.escape(host) + r"(?![\w-])"), "<host>"))
    # Longest first, so a path is replaced before a prefix of it.
    return sorted(set(out), key=lambda kv: -len(kv[0].pattern))


def scrubber(extra: list[str]):
    """The function applied to every text value of an export: path tokens, then the given paths, home, host."""
    pairs = scrub_pairs(extra)

    def scrub(value):
        if not isinstance(value, str):
            return value
        value = scrub_paths(value)
        for pat, new in pairs:
            value = pat.sub(new, value)
        return value
    return scrub


def _distinct(src: str, dst: str) -> pathlib.Path:
    s, d = pathlib.Path(src), pathlib.Path(dst)
    if s.resolve() == d.resolve() or (d.exists() and os.path.samefile(s, d)):
        raise ValueError(f"{dst}: the same file as the source; copy the source to a temporary file first")
    return d


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def strip(src: str, dst: str, extra_paths: list[str] = ()) -> None:
    dst_p = _distinct(src, dst)
    if dst_p.exists():
        dst_p.unlink()
    con = sqlite3.connect(src)
    con.execute("VACUUM INTO ?", (str(dst_p),))  # a copy; the source export stays as nsys wrote it
    con.close()
    con = sqlite3.connect(dst_p)
    con.create_function("scrub", 1, scrubber(list(extra_paths)), deterministic=True)
    tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")]
    if "TARGET_INFO_SYSTEM_ENV" in tables:
        con.execute("DELETE FROM TARGET_INFO_SYSTEM_ENV")
    if "META_DATA_CAPTURE" in tables:  # nsys 2025.3 also keeps the launched process's whole environment here
        con.execute("DELETE FROM META_DATA_CAPTURE WHERE name LIKE '%ENVIRONMENT%'")
    if "StringIds" in tables:  # the environment's NAME=value strings also sit in the string table: blank them
        con.execute("UPDATE StringIds SET value = '' WHERE value GLOB '[A-Za-z_]*=*' "
                    "AND substr(value, 1, instr(value, '=') - 1) NOT GLOB '*[^A-Za-z0-9_]*'")
    for t in tables:
        # every column whatever its declared type: what counts is that the value is text
        for c in (_quote(r[1]) for r in con.execute(f"PRAGMA table_info({_quote(t)})")):
            con.execute(f"UPDATE {_quote(t)} SET {c} = scrub({c}) WHERE typeof({c}) = 'text' AND {c} <> scrub({c})")
    con.commit()
    con.execute("VACUUM")
    con.close()


def _scrub_json(v):
    if isinstance(v, str):
        return scrub_paths(v)
    if isinstance(v, list):
        return [_scrub_json(x) for x in v]
    if isinstance(v, dict):
        return {k: _scrub_json(x) for k, x in v.items()}
    return v


def strip_manifest_data(manifest: dict) -> dict:
    """A run manifest with every absolute path token in its strings (command, steps, tools, node, error)
    replaced by ``<path>/<basename>``; numbers, keys and the rest unchanged."""
    return _scrub_json(manifest)


def strip_manifest(src: str, dst: str) -> None:
    dst_p = _distinct(src, dst)
    text = pathlib.Path(src).read_text()
    data = json.loads(text)
    indents = [len(ln) - len(ln.lstrip(" ")) for ln in text.splitlines() if ln.startswith(" ")]
    tmp = dst_p.with_name(f".{dst_p.name}.tmp")  # the source's indentation kept: a re-strip diffs only paths
    tmp.write_text(json.dumps(strip_manifest_data(data), indent=min(indents, default=2)) + "\n")
    os.replace(tmp, dst_p)


if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):  # help only: nothing built, traced or written
        sys.exit(print(__doc__.strip()))
    if len(sys.argv) < 3:
        raise SystemExit("usage: strip_export.py SRC.sqlite DST.sqlite [PATH_TO_SCRUB ...] | "
                         "strip_export.py SRC/manifest.json DST/manifest.json")
    try:
        if sys.argv[1].endswith(".json"):
            strip_manifest(sys.argv[1], sys.argv[2])
        else:
            strip(sys.argv[1], sys.argv[2],
                  [os.getcwd(), os.path.dirname(os.path.abspath(sys.argv[1]))] + sys.argv[3:])
    except ValueError as e:
        raise SystemExit(f"strip_export.py: {e}") from None
