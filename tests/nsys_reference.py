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
         "ranks/rank0", "ranks/rank1", "ranks/rank2", "capture_trl", "capture_torchrun", "capture_steps")


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


# ---- the RL-step view (phases.csv, steps.csv) against nsys on the same export -----------------------------

def nvidia(case: pathlib.Path, report: str) -> pd.DataFrame:
    path = case / f"{report}.csv"
    return pd.read_csv(path) if path.stat().st_size else pd.DataFrame()


def nvtx_instances(trace: pathlib.Path) -> pd.DataFrame:
    """Every NVTX range instance straight from the export: range name (`domain:message`), start, end, tid."""
    con = sqlite3.connect(f"file:{trace}?mode=ro", uri=True)
    try:
        return pd.read_sql_query("""
            SELECT coalesce((SELECT coalesce(s2.value, d.text) FROM NVTX_EVENTS d LEFT JOIN StringIds s2
                               ON s2.id = d.textId WHERE d.eventType = 75 AND d.domainId = e.domainId
                               AND (d.globalTid >> 24) = (e.globalTid >> 24)), '')
                   || ':' || coalesce(s.value, e.text, '') AS range,
                   e.start, e."end", e.globalTid & 16777215 AS tid
            FROM NVTX_EVENTS e LEFT JOIN StringIds s ON s.id = e.textId WHERE e.eventType IN (59, 60, 70, 71)""",
            con)
    finally:
        con.close()


def check_against_nvidia(case: pathlib.Path, res, trace: pathlib.Path | None = None) -> None:
    """phases.csv against nsys on the same export: instances and total wall span (nvtx_sum), projection and GPU
    ops (nvtx_gpu_proj_sum), host syncs (the four sync rules' rows whose host call lies inside an instance on its
    thread), each step's start and wall span among nvtx_pushpop_trace's instances (where that CSV is there); the
    longest idle gap of any phase is no longer than gpu_gaps' longest. ``case`` holds the CSVs (stats_<report>.csv
    of `nsys stats`, rules_<rule>.csv of tools/fixture_rules.sh), ``trace`` the export (default case/trace.sqlite);
    ``res`` has ``tables["phases"]`` and ``tables["steps"]`` (an analysis result, or phases.csv / steps.csv read
    back: tools/rl_step_walkthrough.sh). AssertionError at the first difference, naming the range."""
    phases = res.tables["phases"].set_index("phase")
    ssum = nvidia(case, "stats_nvtx_sum").set_index("Range")
    proj = nvidia(case, "stats_nvtx_gpu_proj_sum")
    proj = proj.set_index("Range") if not proj.empty else proj
    for rng, p in phases.iterrows():
        assert (p.instances, p.total_ns) == (ssum.loc[rng, "Instances"], ssum.loc[rng, "Total Time (ns)"]), rng
        if rng in proj.index:
            assert (p.proj_total_ns, p.gpu_ops) == (proj.loc[rng, "Total Proj Time (ns)"],
                                                    proj.loc[rng, "Total GPU Ops"]), rng
        else:
            assert (p.proj_total_ns, p.gpu_ops) == (0, 0), rng
    inst = nvtx_instances(trace or case / "trace.sqlite")
    rules = [nvidia(case, f"rules_{r}") for r in ("cuda_api_sync", "cuda_memcpy_sync", "cuda_memcpy_async",
                                                  "cuda_memset_sync")]
    api = rules[0]
    for rng, p in phases.iterrows():
        mine = inst[inst["range"] == rng]
        n = 0
        for r in mine.itertuples(index=False):
            if not api.empty:  # cuda_api_sync reports the host call itself
                n += int(((api["TID"] == r.tid) & (api["Start (ns)"] >= r.start)
                          & (api["Start (ns)"] + api["Duration (ns)"] <= r.end)).sum())
        if all(df.empty for df in rules[1:]):  # the copy rules report the GPU op, not its call: none here
            assert p.host_syncs == n, rng
    trace = case / "stats_nvtx_pushpop_trace.csv"  # per push/pop instance (the capture fixtures have it)
    if trace.is_file() and trace.stat().st_size and not res.tables["steps"].empty:
        pp = nvidia(case, "stats_nvtx_pushpop_trace")
        spans = set(zip(pp["Start (ns)"], pp["Duration (ns)"], strict=True))
        steps = res.tables["steps"]
        assert set(zip(steps["start_ns"], steps["wall_ns"], strict=True)) <= spans
    gaps = nvidia(case, "rules_gpu_gaps")
    longest = [int(g.split(" ns")[0]) for g in phases["longest_gaps"].dropna() for g in g.split("; ")]
    if longest and not gaps.empty:
        assert max(longest) <= gaps["Duration (ns)"].max()
