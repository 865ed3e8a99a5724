"""What the analyzer reads and where it writes: an INPUT resolved to an analysis.Source (a run directory of
pipelines.capture with its manifest, provenance record and ncu.csv, or a bare .sqlite export), the default INPUT
(the newest complete run under ./runs, else the bundled example) and the default report folder of each.
"""
from __future__ import annotations

import json
import pathlib
import re

from pipelines import analysis, trace_db
from pipelines.manifest import read_manifest, read_provenance

EXAMPLE_DIR = pathlib.Path(__file__).resolve().parent / "example"


class UsageError(Exception):
    """Bad usage of the analyzer (exit 2); the message says what to change."""


def _status(run: pathlib.Path) -> str | None:
    try:
        data = json.loads((run / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    return data.get("status") if isinstance(data, dict) else None


def newest_run(root: pathlib.Path) -> pathlib.Path | None:
    """The newest complete run directory: its manifest says ``status: complete`` and it holds a trace (names
    start with a UTC timestamp, so they sort by time; a failed run, ``-failed`` or ``-failed.2``, never counts)."""
    if not root.is_dir():
        return None
    runs = [d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".") and
            (d / "trace.sqlite").is_file() and _status(d) == "complete"]
    return max(runs, key=lambda d: run_order(d.name), default=None)


_SUFFIX = re.compile(r"(.*)\.([0-9]+)")


def run_order(name: str) -> tuple[str, int]:
    """The sort key of a run name: the name without its same-second suffix, then the suffix as a number (none is
    1, ``.2`` the second run of that second, and ``.10`` comes after ``.9``; docs/contracts.md, section 6)."""
    m = _SUFFIX.fullmatch(name)
    return (m.group(1), int(m.group(2))) if m else (name, 1)


def resolve(inp: pathlib.Path) -> analysis.Source:
    """An INPUT -> what to analyze. Raises TraceError naming the file and the problem."""
    try:
        return _resolve(inp)
    except OSError as e:  # a name longer than the file system takes (ENAMETOOLONG), a directory we cannot search
        raise trace_db.TraceError(f"{inp}: cannot read it ({e.strerror or e})") from None


def _resolve(inp: pathlib.Path) -> analysis.Source:
    if inp.is_dir():
        trace = inp / "trace.sqlite"
        manifest = read_manifest(inp / "manifest.json") if (inp / "manifest.json").is_file() else None
        if not trace.is_file():
            why = f" (the capture failed: {manifest.get('error')})" if manifest and manifest.get("status") == "failed" \
                else ""
            exports = _exports_in(inp)
            if exports and not why:  # per-rank exports (nsys per rank, capture --ranks): one job's ranks
                raise trace_db.TraceError(f"{inp}: no trace.sqlite, but {exports} exports in it: for the ranks of one "
                                          f"job use --ranks {inp}; for one of them pass its file")
            raise trace_db.TraceError(f"{inp}: run directory without a trace (no trace.sqlite){why}")
        prov = None
        if (inp / "recorded.json").is_file():
            prov = read_provenance(inp / "recorded.json")
        ncu = inp / "ncu.csv"
        return analysis.Source(trace, inp, manifest, ncu if ncu.is_file() else None, prov)
    if inp.suffix == ".nsys-rep":
        raise trace_db.TraceError(f"{inp}: an nsys report, not its SQLite export; run "
                                  f"`nsys export --type sqlite --output {inp.with_suffix('.sqlite')} {inp}`")
    if not inp.exists():
        raise trace_db.TraceError(f"{inp}: no such file or directory")
    return analysis.Source(inp)


def _exports_in(folder: pathlib.Path) -> int:
    """How many nsys exports a folder without trace.sqlite holds: *.sqlite files, or run directories' traces."""
    try:
        return sum(1 for e in folder.iterdir()
                   if (e.is_file() and e.suffix == ".sqlite") or (e.is_dir() and (e / "trace.sqlite").is_file()))
    except OSError:
        return 0


def default_input() -> pathlib.Path:
    run = newest_run(pathlib.Path("runs"))
    if run is not None:
        return run
    if (EXAMPLE_DIR / "trace.sqlite").is_file():
        return EXAMPLE_DIR
    raise UsageError("no INPUT given, no run under ./runs and no bundled example in this install; "
                     "pass a run directory or a .sqlite nsys export")


def out_dir_for(src: analysis.Source, out: pathlib.Path | None, several: bool) -> pathlib.Path:
    stem = src.run_dir.name if src.run_dir else src.trace.stem
    if out is not None:
        return out / stem if several else out
    if src.run_dir is not None and src.run_dir.resolve() != EXAMPLE_DIR.resolve():
        return src.run_dir / "report"
    return pathlib.Path("reports") / ("example" if src.run_dir == EXAMPLE_DIR else stem)
