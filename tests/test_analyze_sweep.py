"""The per-thread sweep (queries/stage_*.sql) on its own, on hand-built source tables with the boundary cases
real traces rarely show: siblings sharing a timestamp, a zero-length range, a range nested in one of the same
name, overlapping ranges on another thread, a launch outside every range, unclosed ranges."""
from __future__ import annotations

import pytest

from pipelines import sql, trace_db

pytestmark = pytest.mark.smoke

PID = 7 << 24
T1, T2 = PID | 1, PID | 2


def build(ranges, launches):
    """ranges: (name, start, end, tid[, eventType]); launches: (tid, start, end) -> one kernel each."""
    con = trace_db.connect(threads=1)
    trace_db.empty_sources(con)
    for r in ranges:
        name, start, end, tid = r[:4]
        con.execute("INSERT INTO src_NVTX_EVENTS (start, \"end\", eventType, text, globalTid, domainId) "
                    "VALUES (?, ?, ?, ?, ?, 0)", [start, end, r[4] if len(r) > 4 else 59, name, tid])
    con.execute("INSERT INTO src_StringIds VALUES (1, 'k')")
    for i, (tid, start, end) in enumerate(launches):
        con.execute("INSERT INTO src_CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, ?, ?, 0)", [start, end, tid, 100 + i])
        con.execute("INSERT INTO src_CUPTI_ACTIVITY_KIND_KERNEL (start, \"end\", deviceId, streamId, correlationId, "
                    "globalPid, demangledName, shortName) VALUES (?, ?, 0, 7, ?, ?, 1, 1)",
                    [1000 + 10 * i, 1005 + 10 * i, 100 + i, PID])
    sql.stage(con)
    return con


def attribution(con) -> dict[int, list[str]]:
    """correlationId -> sorted names of the ranges the launch counts for."""
    rows = con.execute("""
        SELECT o.correlationId, list_sort(list(r.message))
        FROM gpu_ops o LEFT JOIN range_ops ro USING (op_id) LEFT JOIN ranges r USING (range_id)
        GROUP BY 1 ORDER BY 1""").fetchall()
    return {c: [n for n in names if n is not None] for c, names in rows}


def test_stack_levels_siblings_zero_length_and_threads():
    con = build(
        ranges=[("A", 0, 100, T1), ("B", 10, 50, T1), ("Z", 50, 50, T1), ("D", 50, 90, T1),
                ("A", 60, 70, T1),  # same name nested in A
                ("E", 200, 300, T1), ("F", 0, 100, T2)],
        launches=[(T1, 20, 25), (T1, 62, 63), (T1, 95, 96), (T1, 150, 151), (T2, 30, 31), (T1, 50, 51)])
    got = attribution(con)
    assert got[100] == ["A", "B"]
    assert got[101] == ["A", "A", "D"]  # both A instances: every enclosing level counts
    assert got[102] == ["A"]
    assert got[103] == []  # between ranges
    assert got[104] == ["F"]  # the other thread's range, never T1's
    # A launch call [50, 51]: B closed and Z opened and closed at 50, D opened at 50. nsys's rule
    # (start <= launch start and launch end <= end) holds for A and D only.
    assert got[105] == ["A", "D"]
    depth = dict(con.execute("SELECT r.message || r.start, t.depth FROM range_tree t JOIN ranges r USING (range_id)")
                 .fetchall())
    assert depth == {"A0": 1, "B10": 2, "Z50": 2, "D50": 2, "A60": 3, "E200": 1, "F0": 1}


def test_start_end_ranges_same_thread_and_cross_thread():
    con = build(ranges=[("S", 0, 100, T1, 60), ("S2", 40, 200, T1, 60)],
                launches=[(T1, 10, 11), (T1, 50, 51), (T2, 60, 61)])
    got = attribution(con)
    assert got == {100: ["S"], 101: ["S", "S2"], 102: []}  # overlapping start/end ranges, thread-scoped
    con.execute("UPDATE src_NVTX_EVENTS SET endGlobalTid = ? WHERE text = 'S2'", [T2])
    sql.stage(con)
    got = attribution(con)
    assert got[102] == ["S2"]  # ended on T2: the whole process's launches inside its window


def test_unclosed_range_runs_to_the_last_nvtx_timestamp():
    con = build(ranges=[("open", 0, None, T1), ("later", 500, 600, T1)], launches=[(T1, 550, 551)])
    assert attribution(con)[100] == ["later", "open"]
    # the last timestamp of any NVTX event, a mark or a registration too (nsys's nvtx reports: max over
    # NVTX_EVENTS), not of the ranges alone: a job killed mid-step still writes events after its last range
    con.execute("INSERT INTO src_NVTX_EVENTS (start, \"end\", eventType, text, globalTid, domainId) "
                "VALUES (900, NULL, 34, 'a mark', ?, 0)", [T1])
    sql.stage(con)
    assert con.execute("SELECT \"end\" FROM ranges WHERE message = 'open'").fetchone() == (900,)


def test_a_million_ranges_cost_a_sort_not_a_square():
    """The sweep's work is linear in ranges + launches: 200k nested pairs stage in seconds on one thread."""
    import time

    con = trace_db.connect(threads=1)
    trace_db.empty_sources(con)
    n = 200_000
    con.execute("INSERT INTO src_NVTX_EVENTS (start, \"end\", eventType, text, globalTid, domainId) "
                "SELECT i * 10, i * 10 + 8, 59, 'r', ?, 0 FROM range(?) t(i)", [T1, n])
    con.execute("INSERT INTO src_CUPTI_ACTIVITY_KIND_RUNTIME SELECT i * 10 + 2, i * 10 + 3, ?, i, 0 FROM range(?) t(i)",
                [T1, n])
    con.execute("INSERT INTO src_CUPTI_ACTIVITY_KIND_KERNEL (start, \"end\", correlationId, globalPid) "
                "SELECT i * 10 + 4, i * 10 + 6, i, ? FROM range(?) t(i)", [PID, n])
    t = time.perf_counter()
    sql.stage(con)
    elapsed = time.perf_counter() - t
    assert con.execute("SELECT count(*), count(DISTINCT range_id) FROM range_ops").fetchone() == (n, n)
    # Generous bound (a shared CI core); an interval join would take minutes and gigabytes here.
    assert elapsed < 30, f"staging {n} ranges took {elapsed:.1f} s"


def test_trace_schema_doc_lists_every_table_and_column_read():
    import pathlib

    doc = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "trace-schema.md").read_text()
    for table, cols in trace_db.SCHEMA.items():
        line = next((ln for ln in doc.splitlines() if ln.startswith(f"| `{table}` |")), None)
        assert line is not None, f"docs/trace-schema.md has no row for {table}"
        for c in cols:
            assert f"`{c}`" in line, f"docs/trace-schema.md: {table} row lacks column {c}"


def _scale_start_end(n: int, threads: int, cross: bool):
    """n start/end ranges (eventType 60), one per launch, spread over `threads` threads, each range also
    overlapped by its neighbour (start/end ranges need not nest); cross: every range ended on another thread."""
    con = trace_db.connect(threads=1)
    trace_db.empty_sources(con)
    con.execute("INSERT INTO src_NVTX_EVENTS (start, \"end\", eventType, text, globalTid, endGlobalTid, domainId) "
                "SELECT i * 10, i * 10 + 15, 60, 'r', ? | (i % ?), CASE WHEN ? THEN ? | 99 ELSE NULL END, 0 "
                "FROM range(?) t(i)", [PID, threads, cross, PID, n])
    con.execute("INSERT INTO src_CUPTI_ACTIVITY_KIND_RUNTIME SELECT i * 10 + 2, i * 10 + 3, ? | (i % ?), i, 0 "
                "FROM range(?) t(i)", [PID, threads, n])
    con.execute("INSERT INTO src_CUPTI_ACTIVITY_KIND_KERNEL (start, \"end\", correlationId, globalPid) "
                "SELECT i * 10 + 4, i * 10 + 6, i, ? FROM range(?) t(i)", [PID, n])
    return con


@pytest.mark.parametrize("cross", [False, True], ids=["same-thread", "cross-thread"])
def test_start_end_ranges_cost_a_sort_not_a_square(cross):
    """Start/end ranges overlap freely, yet their attribution is output-sensitive: 200k of them on one thread
    (or ended on another) stage in seconds, with the same pairs as the interval rule."""
    import time

    n = 200_000
    con = _scale_start_end(n, 1, cross)
    t = time.perf_counter()
    sql.stage(con)
    elapsed = time.perf_counter() - t
    # Range i = [10i, 10i+15] holds launch i ([10i+2, 10i+3]) and launch i+1 ([10i+12, 10i+13]).
    assert con.execute("SELECT count(*), count(DISTINCT range_id) FROM range_ops").fetchone() == (2 * n - 1, n)
    assert elapsed < 30, f"staging {n} start/end ranges took {elapsed:.1f} s"


def test_start_end_pairs_equal_the_interval_rule_on_every_boundary():
    """Every (range, launch) pair of the interval rule, no other: launches on a boundary, a launch straddling
    a cross-thread range's end, zero-length ranges, several threads, a launch between ranges."""
    con = build(
        ranges=[("a", 0, 100, T1, 60), ("b", 50, 50, T1, 60), ("c", 20, 51, T1, 60), ("d", 51, 300, T1, 60),
                ("e", 0, 100, T2, 60), ("x", 30, 61, T1, 60)],
        launches=[(T1, 0, 1), (T1, 50, 50), (T1, 50, 51), (T1, 51, 52), (T1, 99, 100), (T1, 100, 101),
                  (T2, 60, 62), (T2, 120, 121), (T1, 400, 401)])
    con.execute("UPDATE src_NVTX_EVENTS SET endGlobalTid = ? WHERE text = 'x'", [T2])
    sql.stage(con)
    got = con.execute("SELECT r.message, o.correlationId FROM range_ops JOIN ranges r USING (range_id) "
                      "JOIN gpu_ops o USING (op_id) ORDER BY 1, 2").fetchall()
    want = con.execute("""
        SELECT r.message, o.correlationId FROM ranges r JOIN gpu_ops o
          ON (CASE WHEN r.scope = 'thread' THEN o.launch_tid = r.tid ELSE (o.launch_tid >> 24) = r.proc END)
         AND o.launch_start >= r.start AND o.launch_end <= r."end"
        ORDER BY 1, 2""").fetchall()
    assert got == want
    assert ("b", 101) in got and ("x", 106) not in got and ("x", 102) in got


def test_staging_reports_each_step_and_speaks_during_a_long_one(capsys):
    """Progress names the stage step now running (k of n), and repeats while one step runs long."""
    import time

    from pipelines import analysis

    con = trace_db.connect(threads=1)
    trace_db.empty_sources(con)
    steps = []
    sql.stage(con, lambda step, done, total: steps.append((step, done, total)))
    assert [s[0] for s in steps][:3] == ["verdict_over", "gpu_ops", "ranges"] and steps[-1][0] == "range_instances"
    assert [s[1] for s in steps] == list(range(len(steps))) and {s[2] for s in steps} == {len(steps)}
    beat = analysis.Heartbeat("t.sqlite", every=0.1)
    with beat.running():
        beat("range_ops", 7, 10)
        time.sleep(0.45)  # a step that outlasts several heartbeats
    err = capsys.readouterr().err
    assert "t.sqlite: staging range_ops (step 8 of 10, " in err
    assert err.count("still staging range_ops (step 8 of 10, ") >= 2


def test_trace_schema_doc_names_every_output_column():
    import pathlib

    from pipelines import analysis

    doc = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "trace-schema.md").read_text()
    section = doc.split("## Output columns", 1)[1].split("\n## ", 1)[0]
    for name, cols in analysis.COLUMNS.items():
        part = section.split(f"`{name}.csv`", 1)
        assert len(part) == 2, f"docs/trace-schema.md, Output columns: no paragraph for {name}.csv"
        para = part[1].split("\n\n", 1)[0]
        for c in cols:
            assert f"`{c}`" in para, f"{name}.csv: column {c} undocumented"
