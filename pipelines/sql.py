"""The analyzer's SQL: one question per file in ``queries/``, read by name, run with bound parameters.

``stage_*`` files build the temp tables the questions read (run in :data:`STAGES` order, no parameters);
every other file is one SELECT whose user-supplied values arrive as DuckDB parameters, never as text.
"""
from __future__ import annotations

import functools
import pathlib
import re
from collections.abc import Callable

import duckdb

from pipelines import datafiles

STAGES = ("stage_macros", "stage_gpu_ops", "stage_ranges", "stage_range_tree", "stage_host_syncs", "stage_range_ops",
          "stage_range_instances")


def _query_dir() -> pathlib.Path:
    return datafiles.folder("queries")


@functools.cache
def text(name: str) -> str:
    path = _query_dir() / f"{name}.sql"
    if not path.is_file():
        raise FileNotFoundError(f"no query named {name!r} in {path.parent}")
    return path.read_text()


@functools.cache
def statements(name: str) -> tuple[str, ...]:
    """The file's statements, one by one (full-line comments dropped; a statement ends with `;` at line end)."""
    body = "\n".join(ln for ln in text(name).splitlines() if not ln.lstrip().startswith("--"))
    return tuple(s.strip() for s in re.split(r";[ \t]*(?:\n|$)", body) if s.strip())


def stage(con: duckdb.DuckDBPyConnection, on_step: Callable[[str, int, int], None] | None = None) -> None:
    """Run the stage files in order, statement by statement; ``on_step(table, done, total)`` before each one
    (progress for traces whose staging takes minutes)."""
    steps = [st for name in STAGES for st in statements(name)]
    for i, st in enumerate(steps):
        if on_step is not None:
            m = re.search(r"TEMP (?:TABLE|MACRO) (\w+)", st)
            on_step(m.group(1) if m else "?", i, len(steps))
        con.execute(st)


def frame(con: duckdb.DuckDBPyConnection, name: str, params: dict | None = None):
    """The query's result as a pandas DataFrame."""
    return con.execute(text(name), params or {}).df()
