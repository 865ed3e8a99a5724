"""The analyzer's SQL: one question per file in ``queries/``, read by name, run with bound parameters.

``stage_*`` files build the temp tables the questions read (run in :data:`STAGES` order, no parameters);
every other file is one SELECT whose user-supplied values arrive as DuckDB parameters, never as text.
"""
from __future__ import annotations

import functools
import importlib.resources
import pathlib

import duckdb

STAGES = ("stage_gpu_ops", "stage_ranges", "stage_range_tree", "stage_range_ops")


def _query_dir() -> pathlib.Path:
    here = pathlib.Path(__file__).resolve().parent.parent / "queries"
    if here.is_dir():
        return here
    return pathlib.Path(str(importlib.resources.files("queries")))  # installed as a data package


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
