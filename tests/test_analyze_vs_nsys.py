"""The analyzer's CSVs equal what `nsys stats` printed for the same real H200 exports (tests/data/<case>/).

Tolerances: integers (counts, totals, min, max) exactly. Averages, medians and standard deviations within
1 ns: both sides round to 0.1 ns, and the issue's bar is 1 ns. time_pct within 0.1 (both round to 0.1 %).
nsys splits nvtx_kern_sum rows by PID and TID where ours are per range and kernel: where one key has several
nsys rows, the additive columns are compared (instances, total, min, max); the others need the single row.
"""
from __future__ import annotations

import pathlib

import pytest

from pipelines import analysis
from tests.nsys_reference import CASES, DATA, analyzed, cross_thread_ranges, stats

pytestmark = pytest.mark.smoke
STAT_TOL_NS = 1.0  # averages/medians/stddevs: both round to 0.1 ns; the issue asks for 1 ns
PCT_TOL = 0.1  # time_pct: both round to 0.1 %


@pytest.fixture(scope="module")
def results():
    return analyzed


def close(a, b, tol):
    return abs(float(a) - float(b)) <= tol


@pytest.mark.parametrize("case", CASES)
def test_kernel_summary_equals_cuda_gpu_kern_sum(results, case):
    ref = stats(case, "cuda_gpu_kern_sum")
    ours = results(case).tables["kernel_summary"]
    if ref.empty:
        assert ours.empty, "nsys found no kernels, the analyzer did"
        return
    assert sorted(ours["kernel"]) == sorted(ref["Name"])
    mine = ours.set_index("kernel")
    for r in ref.itertuples(index=False):
        m = mine.loc[r.Name]
        assert (m.instances, m.total_ns, m.min_ns, m.max_ns) == (r.Instances, r[1], r[5], r[6]), r.Name
        for ours_v, ref_v in ((m.avg_ns, r[3]), (m.med_ns, r[4]), (m.stddev_ns, r[7])):
            assert close(ours_v, ref_v, STAT_TOL_NS), (r.Name, ours_v, ref_v)
        assert close(m.time_pct, r[0], PCT_TOL), (r.Name, m.time_pct, r[0])
    # Row order: total time descending, as nsys orders it.
    assert list(ours["total_ns"]) == sorted(ours["total_ns"], reverse=True)


@pytest.mark.parametrize("case", CASES)
def test_range_summary_equals_nvtx_sum(results, case):
    ref = stats(case, "nvtx_sum")
    ours = results(case).tables["range_summary"]
    if ref.empty:
        assert ours.empty
        return
    mine = {(r.range, r.style): r for r in ours.itertuples(index=False)}
    assert set(mine) == {(r.Range, r.Style) for r in ref.itertuples(index=False)}
    for r in ref.itertuples(index=False):
        m = mine[(r.Range, r.Style)]
        assert (m.instances, m.range_total_ns) == (r.Instances, r[1]), r.Range


@pytest.mark.parametrize("case", CASES)
def test_range_projection_equals_nvtx_gpu_proj_sum(results, case):
    ref = stats(case, "nvtx_gpu_proj_sum")
    ours = results(case).tables["range_summary"]
    cross = cross_thread_ranges(case)
    proj = {(r.Range, r.Style): r for r in ref.itertuples(index=False)} if not ref.empty else {}
    for m in ours.itertuples(index=False):
        r = proj.get((m.range, m.style))
        if r is None:
            # nsys lists only ranges that project GPU work, and never those ended on another thread.
            assert m.range in cross or (m.proj_total_ns, m.gpu_ops) == (0, 0), m.range
            continue
        assert (m.proj_total_ns, m.gpu_ops, m.range_total_ns) == (r[2], r[10], r[3]), m.range
    assert set(proj) <= {(m.range, m.style) for m in ours.itertuples(index=False)}


@pytest.mark.parametrize("case", CASES)
def test_range_kernels_equal_nvtx_kern_sum(results, case):
    ref = stats(case, "nvtx_kern_sum")
    ours = results(case).tables["range_kernels"]
    cross = cross_thread_ranges(case)
    ours = ours[~ours["range"].isin(cross)]  # nsys attributes nothing to these
    if ref.empty:
        assert ours.empty
        return
    groups = ref.groupby(["NVTX Range", "Style", "Kernel Name"], sort=False)
    assert {(r.range, r.style, r.kernel) for r in ours.itertuples(index=False)} == set(groups.groups)
    mine = ours.set_index(["range", "style", "kernel"])
    for key, g in groups:
        m = mine.loc[key]
        assert m.kernel_instances == g["Kern Inst"].sum(), key
        assert m.total_ns == g["Total Time (ns)"].sum(), key
        assert (m.min_ns, m.max_ns) == (g["Min (ns)"].min(), g["Max (ns)"].max()), key
        if len(g) == 1:
            r = g.iloc[0]
            for ours_v, col in ((m.avg_ns, "Avg (ns)"), (m.med_ns, "Med (ns)"), (m.stddev_ns, "StdDev (ns)")):
                assert close(ours_v, r[col], STAT_TOL_NS), (key, col, ours_v, r[col])


def test_the_cases_cover_what_the_issue_lists(results):
    """Guard against fixtures that silently lose a case: each trait is present in the data compared above."""
    mix = results("nvtx_mix").tables["range_summary"]
    names = set(mix["range"])
    assert {":outer", ":inner"} <= names  # default domain, inline text, nesting (same name nested)
    assert "app:step" in names  # named domain, registered string
    assert any(n.startswith("CCCL:") for n in names)  # CUB's own ranges
    assert {"StartEnd"} <= set(mix["style"])
    assert cross_thread_ranges("nvtx_mix") == {"app:startend_cross_thread"}
    # Projection follows a kernel that ran long after its range closed.
    ltc = mix.set_index("range").loc[":launch_then_close"]
    assert ltc.proj_total_ns > ltc.range_total_ns
    # Graph node kernels belong to the replay range: 4 kernels per replay, one GPU op (one graph launch).
    g = results("graphs")
    rk = g.tables["range_kernels"]
    assert rk.loc[rk["range"] == ":replay", "kernel_instances"].sum() == 12
    assert g.tables["range_summary"].set_index("range").loc[":replay", "gpu_ops"] == 3
    # Two processes, each naming its own domains.
    mp = results("multiproc").tables["range_summary"].set_index("range")
    assert mp.loc["worker:proc_work", "instances"] == 5 and "extra0:only_in_child0" in mp.index
    assert results("no_nvtx").tables["range_summary"].empty
    assert results("no_cuda").tables["kernel_summary"].empty


def test_cross_thread_start_end_range_gets_the_process_launches_in_its_window(results):
    r = results("nvtx_mix")
    rs = r.tables["range_summary"].set_index("range")
    assert rs.loc["app:startend_cross_thread", "gpu_ops"] > 0
    rk = r.tables["range_kernels"]
    kernels = set(rk.loc[rk["range"] == "app:startend_cross_thread", "kernel_short"])
    # abs_ on the main thread, the worker thread's mul/sqrt: launches of both threads inside the window.
    assert "vectorized_elementwise_kernel" in kernels
    assert rs.loc["app:startend_cross_thread", "gpu_ops"] >= 4


def test_fixtures_stay_small():
    total = sum(p.stat().st_size for p in pathlib.Path(DATA).rglob("*") if p.is_file())
    assert total <= 15 * 1024 * 1024, f"tests/data is {total / 2**20:.1f} MB, the limit is 15 MB"
    example = pathlib.Path(analysis.__file__).parent / "example"
    if example.is_dir():
        size = sum(p.stat().st_size for p in example.rglob("*") if p.is_file())
        assert size <= 5 * 1024 * 1024, f"the bundled example is {size / 2**20:.1f} MB"


def test_no_fixture_carries_the_traced_environment():
    import sqlite3

    example = pathlib.Path(analysis.__file__).parent / "example"
    for db in sorted([*pathlib.Path(DATA).rglob("*.sqlite"), *example.glob("*.sqlite")]):
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if "TARGET_INFO_SYSTEM_ENV" in tables:
            assert con.execute("SELECT count(*) FROM TARGET_INFO_SYSTEM_ENV").fetchone()[0] == 0, db
        if "META_DATA_CAPTURE" in tables:
            n = con.execute("SELECT count(*) FROM META_DATA_CAPTURE WHERE name LIKE '%ENVIRONMENT%'").fetchone()[0]
            assert n == 0, db
        con.close()



def test_verl_style_start_end_ranges_are_in_the_compared_data(results):
    """verl_ranges: start/end ranges in a named domain that overlap without nesting, and one ended on another
    thread; sync_loop: push/pop ranges with syncs and copies inside. Both are compared above."""
    rs = results("verl_ranges").tables["range_summary"].set_index("range")
    assert {"verl:step", "verl:gen", "verl:old_log_prob", "verl:ref", "verl:update_actor"} <= set(rs.index)
    assert set(rs.loc[["verl:old_log_prob", "verl:ref"], "style"]) == {"StartEnd"}
    assert cross_thread_ranges("verl_ranges") == {"verl:async_rollout"}
    import sqlite3

    con = sqlite3.connect(f"file:{DATA / 'verl_ranges' / 'trace.sqlite'}?mode=ro", uri=True)
    overlap = con.execute("""
        SELECT count(*) FROM NVTX_EVENTS a, NVTX_EVENTS b
        WHERE a.eventType = 60 AND b.eventType = 60 AND a.start < b.start AND b.start < a."end"
          AND a."end" < b."end" """).fetchone()[0]
    con.close()
    assert overlap >= 3  # old_log_prob/ref in each of the three steps
    sl = results("sync_loop").tables["range_summary"].set_index("range")
    assert sl.loc["rl:train_step", "instances"] == 4
