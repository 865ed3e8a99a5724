"""Report files: new ``profile_<UTC timestamp with microseconds>.csv`` / ``.json`` per run, written atomically.

Both files of a run share one stem. Each is written to a temporary file in the output folder and
renamed into place only when all requested files are complete, so a failure leaves no half-written
report and no existing file is ever appended to or overwritten.
"""
from __future__ import annotations

import csv
import datetime as dt
import io
import json
import os
import tempfile
import time
from pathlib import Path

from rlkernel.profiling.rows import COLUMNS
from rlkernel.textsafe import to_spreadsheet

REPORT_VERSION = "1.0"


def _stem(now: dt.datetime) -> str:
    return "profile_" + now.strftime("%Y%m%dT%H%M%S_%fZ")


def fresh_stem(output_dir: Path, suffixes: list[str]) -> str:
    """A stem no file in ``output_dir`` has yet (a later microsecond if this one is taken)."""
    while True:
        stem = _stem(dt.datetime.now(dt.timezone.utc))
        if not any((output_dir / f"{stem}{s}").exists() for s in suffixes):
            return stem
        time.sleep(1e-6)


def csv_text(rows: list[dict]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if row[k] is None else to_spreadsheet(row[k])) for k in COLUMNS})
    return buf.getvalue()


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
    stem = fresh_stem(output_dir, list(texts))
    temps: dict[str, str] = {}
    try:
        for suffix, text in texts.items():
            fd, tmp = tempfile.mkstemp(prefix=f".{stem}", suffix=suffix + ".tmp", dir=output_dir)
            temps[suffix] = tmp
            with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        finals: list[Path] = []
        try:
            for suffix, tmp in temps.items():
                final = output_dir / f"{stem}{suffix}"
                os.replace(tmp, final)
                finals.append(final)
        except BaseException:
            for final in finals:  # a pair is written whole or not at all: undo the renames already done
                final.unlink(missing_ok=True)
            raise
        return finals
    finally:
        for tmp in temps.values():
            if os.path.exists(tmp):
                os.unlink(tmp)
