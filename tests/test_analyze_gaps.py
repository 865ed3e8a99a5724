"""GPU idle gaps and utilisation (issue 18, item 3): the whole-trace gap table and utilisation equal NVIDIA's
`nsys analyze` rules gpu_gaps (gap=1 ms) and gpu_time_util (threshold=100 %, 30 chunks) on every fixture
(rules_<rule>.csv, made on the H200 by tools/fixture_rules.sh); per workload repetition, the longest gaps and what
the host thread did meanwhile."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from pipelines import analysis, sql, trace_db
from tests.nsys_reference import DATA

pytestmark = pytest.mark.smoke
RULE_CASES = sorted(p.parent.name for p in DATA.glob("*/rules_gpu_gaps.csv"))


def rule_csv(case, rule="gpu_gaps"):
    """NVIDIA's rule output; a rule that found nothing wrote an empty file (tools/fixture_rules.sh): no rows."""
    path = DATA / case / f"rules_{rule}.csv"
    if path.stat().st_size == 0:
        return pd.DataFrame(columns=["Duration (ns)", "Start (ns)", "PID", "Device ID"])
    return pd.read_csv(path)


def staged(case):
    trace = trace_db.open_trace(DATA / case / "trace.sqlite")
    sql.stage(trace.con)
    return trace.con


def test_the_stored_rules_found_gaps_and_concurrency():
    # never vacuous: at least 7 fixtures where nsys found 4 gaps or more; one where it found none (capture_steps: a
    # tight loop, no gap of 1 ms) checks that the analyzer finds none either
    with_gaps = [case for case in RULE_CASES if len(rule_csv(case)) >= 4]
    assert len(with_gaps) >= 7, with_gaps
    assert all(len(rule_csv(case)) == 0 or case in with_gaps for case in RULE_CASES)
    util = pd.read_csv(DATA / "sync_loop" / "rules_gpu_time_util.csv")
    assert util["In-Use (%)"].iloc[0] > 0  # overlapping streams there: in-use (sum) differs from busy (union)


@pytest.mark.parametrize("case", RULE_CASES)
def test_gaps_equal_gpu_gaps(case):
    got = sql.frame(staged(case), "gpu_gaps", {"gap_ns": 1_000_000})
    ref = rule_csv(case)
    assert list(zip(got.gap_ns, got.start_ns, got.pid, got.device_id, strict=True)) == \
        list(zip(ref["Duration (ns)"], ref["Start (ns)"], ref["PID"], ref["Device ID"], strict=True))
    assert (got.end_ns - got.start_ns == got.gap_ns).all()


@pytest.mark.parametrize("case", RULE_CASES)
def test_utilisation_equals_gpu_time_util(case):
    got = sql.frame(staged(case), "gpu_time_util", {"chunks": 30, "threshold": 100})
    ref = pd.read_csv(DATA / case / "rules_gpu_time_util.csv")
    assert sorted(zip(got.start_ns, got.dur_ns, got.pid, got.device_id, strict=True)) == \
        sorted(zip(ref["Start (ns)"], ref["Duration (ns)"], ref["PID"], ref["Device ID"], strict=True))
    mine = dict(zip(got.start_ns, got.in_use_pct, strict=True))
    for start, pct in zip(ref["Start (ns)"], ref["In-Use (%)"], strict=True):
        assert abs(mine[start] - pct) <= 0.1, (case, start)  # both round to 0.1 %


def test_utilisation_keeps_every_chunk_in_the_report():
    res = analysis.analyze(analysis.Source(DATA / "sync_loop" / "trace.sqlite"))
    u = res.tables["utilization"]
    assert len(u) == 1 and u.in_use_pct.iloc[0] == pytest.approx(2.4, abs=0.1)
    assert u.busy_pct.iloc[0] < u.in_use_pct.iloc[0]  # the two spin kernels overlap: counted once in busy
    assert list(res.tables["gaps"].gap_ns) == list(pd.read_csv(DATA / "sync_loop" / "rules_gpu_gaps.csv")
                                                   ["Duration (ns)"])


def test_repetition_gaps_say_what_the_host_did():
    res = analysis.analyze(analysis.Source(DATA / "sync_loop" / "trace.sqlite"), ranges=["rl:train_step"])
    g = res.tables["repetition_gaps"]
    assert list(g.columns) == analysis.COLUMNS["repetition_gaps"]
    first = g[g["gap_rank"] == 1]
    assert len(first) == 4 and (first.workload == "rl:train_step").all()
    # Each step's longest gap holds its 2 ms host sleep: the host was outside CUDA most of that time, after the
    # item() sync (cudaStreamSynchronize) that opened the gap.
    assert (first.gap_ns > 2_000_000).all() and (first.outside_calls_ns > 1_900_000).all()
    assert (first.host_syncs >= 1).all() and first.longest_calls.str.contains("cudaStreamSynchronize").all()
    assert g.groupby("instance").size().eq(analysis.REPETITION_GAPS).all()


def test_the_examples_fused_repetitions_gap_on_the_item_sync():
    m = json.loads((DATA / "example_with_sync" / "manifest.json").read_text())
    res = analysis.analyze(analysis.Source(DATA / "example_with_sync" / "trace.sqlite", None, m))
    g = res.tables["repetition_gaps"]
    top = g[(g.workload == "rlkernel:logp-fused") & (g["gap_rank"] == 1)]
    assert len(top) == 3 and (top.host_syncs == 1).all()
    assert top.longest_calls.str.contains("cudaMemcpyAsync").all()
