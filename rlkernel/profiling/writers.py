"""Report files: new ``profile_<UTC timestamp with microseconds>[-N].csv`` / ``.json`` per run, written atomically.

Both files of a run share one stem. Each is written to a temporary file in the output folder and
hard-linked to its final name only when all requested files are complete, so a failure leaves no
half-written report, and no existing file is ever appended to or overwritten: a name taken by another
run (same microsecond) sends this run to the next free one, ``-2``, ``-3``, ...
"""
from __future__ import annotations

import csv
import datetime as dt
import io
import json
import os
import secrets
from pathlib import Path

from rlkernel.profiling.rows import COLUMNS
from rlkernel.textsafe import lf_row_ends, to_spreadsheet

REPORT_VERSION = "1.0"
SUFFIXES = (".csv", ".json")  # every file a run may write: a stem with any of them taken is someone else's


def _stem(now: dt.datetime) -> str:
    return "profile_" + now.strftime("%Y%m%dT%H%M%S_%fZ")


def _claim(output_dir: Path, stem: str, temps: dict[str, str]) -> list[Path] | None:
    """Give every complete temporary file its final name under ``stem``; None, with nothing linked, when a name is
    taken. ``os.link`` fails on an existing name (a rename would replace it), so another run's file is never
    overwritten, even by a run that checked the name in the same instant. The names of the suffixes this run does
    not write are checked too (not atomically), so a --csv run and a --json run do not pass for one pair."""
    if any((output_dir / f"{stem}{s}").exists() for s in SUFFIXES if s not in temps):
        return None
    linked: list[Path] = []
    try:
        for suffix, tmp in temps.items():
            final = output_dir / f"{stem}{suffix}"
            os.link(tmp, final)
            linked.append(final)
    except BaseException as exc:
        for final in linked:  # a pair is named whole or not at all: this run's links only
            final.unlink(missing_ok=True)
        if isinstance(exc, FileExistsError):
            return None
        raise
    return linked


def _create_temp(output_dir: Path, suffix: str) -> tuple[int, str]:
    """A new hidden file in ``output_dir``, mode 0666 less the umask, like any file a program creates (mkstemp's
    0600 would stay on the report after the link, unlike the analyzer's files)."""
    while True:
        tmp = str(output_dir / f".profile_{secrets.token_hex(8)}{suffix}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue


def _write_all(fd: int, data: bytes) -> None:
    """Every byte of a report goes through here."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def csv_text(rows: list[dict]) -> str:
    buf = io.StringIO()
    # CRLF while writing, so a cell holding a bare CR is quoted too, then LF row ends (textsafe.lf_row_ends)
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\r\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if row[k] is None else to_spreadsheet(row[k])) for k in COLUMNS})
    return lf_row_ends(buf.getvalue())


def json_text(rows: list[dict], *, command: str, node: dict, generated_at: str) -> str:
    doc = {"report_version": REPORT_VERSION, "generated_at": generated_at, "command": command, "node": node,
           "rows": [{k: row[k] for k in COLUMNS} for row in rows]}
    return json.dumps(doc, indent=2, allow_nan=False) + "\n"


def write_reports(output_dir: Path, rows: list[dict], *, csv_out: bool, json_out: bool, command: str,
                  node: dict, generated_at: str) -> list[Path]:
    """Write the requested files; return their paths. Nothing is left behind if any write fails."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    texts = {}
    if csv_out:
        texts[".csv"] = csv_text(rows)
    if json_out:
        texts[".json"] = json_text(rows, command=command, node=node, generated_at=generated_at)
    temps: dict[str, str] = {}
    try:
        for suffix, text in texts.items():
            fd, temps[suffix] = _create_temp(output_dir, suffix)
            try:
                _write_all(fd, text.encode("utf-8"))
                os.fsync(fd)
            finally:
                os.close(fd)
        stem, n = _stem(dt.datetime.now(dt.timezone.utc)), 1
        while True:  # the run's own name, then the next free one: <stem>-2, <stem>-3, ...
            finals = _claim(output_dir, stem if n == 1 else f"{stem}-{n}", temps)
            if finals is not None:
                return finals
            n += 1
    finally:
        for tmp in temps.values():  # the final names are links: the temporary names go either way
            if os.path.exists(tmp):
                os.unlink(tmp)
