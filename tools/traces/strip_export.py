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
committed fixture to a temporary file first). DST is written whole or not at all (a temporary file beside it, then
one rename). Exit codes: 0 written; 1 the work failed (DST as it was); 2 bad usage or input (one line, nothing
written).
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


def _check_paths(src: str, dst: str, sqlite: bool) -> pathlib.Path:
    """DST as a path, after the checks that come before anything is written: SRC a readable file (an SQLite
    database for an export: its 16-byte header), DST not SRC, not a directory, in a directory that exists."""
    s = pathlib.Path(src)
    if not s.is_file():
        raise ValueError(f"{src}: no such file" if not s.exists() else f"{src}: not a file")
    if sqlite:
        try:
            with s.open("rb") as f:
                head = f.read(16)
        except OSError as e:
            raise ValueError(f"{src}: cannot read it ({e.strerror or e})") from None
        if head != b"SQLite format 3\x00":
            raise ValueError(f"{src}: not an SQLite database (an nsys export: nsys export --type sqlite)")
    d = _distinct(src, dst)
    if d.is_dir():
        raise ValueError(f"{dst}: a directory; give the file to write")
    if not d.parent.is_dir():
        raise ValueError(f"{d.parent}: no such directory")
    return d


def _write_beside(dst: pathlib.Path, fill) -> None:
    """fill(tmp) writes the result into a temporary file beside DST, which then replaces DST in one rename: on
    any failure DST is as it was (an existing fixture is not lost) and the temporary file is gone."""
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    try:
        tmp.unlink(missing_ok=True)
        fill(tmp)
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def strip(src: str, dst: str, extra_paths: list[str] = ()) -> None:
    dst_p = _check_paths(src, dst, sqlite=True)
    _write_beside(dst_p, lambda tmp: _strip_into(src, tmp, list(extra_paths)))


def _strip_into(src: str, tmp: pathlib.Path, extra_paths: list[str]) -> None:
    # read-only URI: a source that vanished in between is an error, never an empty database created in its place
    con = sqlite3.connect(f"file:{pathlib.Path(src).resolve().as_posix()}?mode=ro", uri=True)
    try:
        con.execute("VACUUM INTO ?", (str(tmp),))  # a copy; the source export stays as nsys wrote it
    finally:
        con.close()
    con = sqlite3.connect(tmp)
    try:
        con.create_function("scrub", 1, scrubber(extra_paths), deterministic=True)
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
                con.execute(f"UPDATE {_quote(t)} SET {c} = scrub({c}) WHERE typeof({c}) = 'text' AND "
                            f"{c} <> scrub({c})")
        con.commit()
        con.execute("VACUUM")
    finally:
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
    dst_p = _check_paths(src, dst, sqlite=False)
    text = pathlib.Path(src).read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{src}: not JSON ({e})") from None
    indents = [len(ln) - len(ln.lstrip(" ")) for ln in text.splitlines() if ln.startswith(" ")]
    out = json.dumps(strip_manifest_data(data), indent=min(indents, default=2)) + "\n"
    # the source's indentation kept: a re-strip diffs only paths
    _write_beside(dst_p, lambda tmp: tmp.write_text(out))


USAGE = ("usage: strip_export.py SRC.sqlite DST.sqlite [PATH_TO_SCRUB ...] | "
         "strip_export.py SRC/manifest.json DST/manifest.json")


def main(argv: list[str]) -> int:
    """Exit codes: 0 written; 1 the work failed (an SQLite or file-system error: DST left as it was); 2 bad usage
    or input (named in one line, nothing written)."""
    if argv[:1] in (["-h"], ["--help"]):  # help only: nothing built, traced or written
        print(__doc__.strip())
        return 0
    if len(argv) < 2 or any(a.startswith("-") for a in argv):
        print(USAGE, file=sys.stderr)
        return 2
    try:
        if argv[0].endswith(".json"):
            strip_manifest(argv[0], argv[1])
        else:
            strip(argv[0], argv[1], [os.getcwd(), os.path.dirname(os.path.abspath(argv[0]))] + argv[2:])
    except ValueError as e:
        print(f"strip_export.py: {e}", file=sys.stderr)
        return 2
    except (OSError, sqlite3.Error) as e:
        print(f"strip_export.py: {argv[1]} not written: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
