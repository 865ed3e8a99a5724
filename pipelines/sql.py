"""The analyzer's SQL: one question per file in ``queries/``, read by name, run with bound parameters.

``stage_*`` files build the temp tables the questions read (run in :data:`STAGES` order, no parameters);
every other file is one SELECT whose user-supplied values arrive as DuckDB parameters, never as text.
"""
from __future__ import annotations

import functools
import pathlib

import duckdb

from pipelines import datafiles

STAGES = ("stage_gpu_ops", "stage_ranges", "stage_range_tree", "stage_range_ops")


def _query_dir() -> pathlib.Path:
    return datafiles.folder("queries")


@functools.cache
def text(name: str) -> str:
    path = _query_dir() / f"{name}.sql"
    if not path.is_file():
        raise FileNotFoundError(f"no query named {name!r} in {path.parent}")
    return path.read_text()


def stage(con: duckdb.DuckDBPyConnection) -> None:
    for name in STAGES:
        con.execute(text(name))


def frame(con: duckdb.DuckDBPyConnection, name: str, params: dict | None = None):
    """The query's result as a pandas DataFrame."""
    return con.execute(text(name), params or {}).df()
