"""Read the `nsys stats` CSVs stored beside each fixture trace (tests/data/<case>/stats_<report>.csv).

A case `ranks/rank<N>` is one rank of the per-rank job in tests/data/ranks/ (tools/traces/ranks.py, three processes
each under its own nsys): its trace is trace_rank<N>.sqlite and its CSVs stats_rank<N>_<report>.csv.
"""
from __future__ import annotations

import functools
import pathlib
import sqlite3

import pandas as pd

DATA = pathlib.Path(__file__).resolve().parent / "data"
CASES = ("nvtx_mix", "verdicts", "graphs", "multiproc", "no_nvtx", "no_cuda", "verl_ranges", "sync_loop",
         "ranks/rank0", "ranks/rank1", "ranks/rank2", "capture_trl")


def trace_path(case: str) -> pathlib.Path:
    folder, _, rank = case.partition("/")
    return DATA / folder / (f"trace_{rank}.sqlite" if rank else "trace.sqlite")


def _stats_path(case: str, report: str) -> pathlib.Path:
    folder, _, rank = case.partition("/")
    return DATA / folder / (f"stats_{rank}_{report}.csv" if rank else f"stats_{report}.csv")


@functools.cache
def analyzed(case: str):
    """The analyzer's result on a fixture, once per test session (the trace is read-only)."""
    from pipelines import analysis

    return analysis.analyze(analysis.Source(trace_path(case)))


def stats(case: str, report: str) -> pd.DataFrame:
    """One report's rows; an empty frame where nsys skipped the report (no data of that kind: empty file)."""
    path = _stats_path(case, report)
    if path.stat().st_size == 0:
        return pd.DataFrame()
    return pd.read_csv(path, keep_default_na=False, na_values=[])


def cross_thread_ranges(case: str) -> set[str]:
    """Names (`domain:message`) of start/end ranges ended on another thread, read straight from the export:
    nsys reports none for them, the analyzer attributes the process's launches in their window."""
    con = sqlite3.connect(f"file:{trace_path(case)}?mode=ro", uri=True)
    try:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if "NVTX_EVENTS" not in tables:
            return set()
        rows = con.execute("""
            SELECT coalesce((SELECT coalesce(s2.value, d.text) FROM NVTX_EVENTS d LEFT JOIN StringIds s2
                               ON s2.id = d.textId
                             WHERE d.eventType = 75 AND d.domainId = e.domainId
                               AND (d.globalTid >> 24) = (e.globalTid >> 24)), '')
                   || ':' || coalesce(s.value, e.text, '')
            FROM NVTX_EVENTS e LEFT JOIN StringIds s ON s.id = e.textId
            WHERE e.eventType IN (60, 71) AND e.endGlobalTid IS NOT NULL AND e.endGlobalTid <> e.globalTid""")
        return {r[0] for r in rows}
    finally:
        con.close()
