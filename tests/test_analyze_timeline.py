"""The report's timeline and first calls (issue 18, item 5): per workload, its repetition with the median GPU busy
time as inline SVG (NVTX ranges as rows, kernels/copies/sets on the GPU row, syncs marked, idle time shaded, no
script); each op range's first call shown apart from its steady state."""
from __future__ import annotations

import json
import re

import pytest

from pipelines import analysis, analyze
from tests.nsys_reference import DATA

pytestmark = pytest.mark.smoke
CASE = DATA / "example_with_sync"


@pytest.fixture(scope="module")
def res():
    m = json.loads((CASE / "manifest.json").read_text())
    return analysis.analyze(analysis.Source(CASE / "trace.sqlite", CASE, m))


def test_the_drawn_repetition_is_the_median_one(res):
    d = res.tables["dispatch"]
    for wl, items in res.timeline.groupby("workload"):
        reps = d[(d.level == "workload") & (d.range == wl)].sort_values(["gpu_busy_ns", "instance"])
        median = reps.iloc[(len(reps) - 1) // 2]
        outer = items[(items.kind == "range") & (items.lane == 0)]
        assert list(outer.start_ns) == [median.start_ns], wl
        assert list(outer.end_ns) == [median.end_ns], wl
    fused = res.timeline[res.timeline.workload == "rlkernel:logp-fused"]
    assert set(fused.kind) == {"range", "kernel", "memset", "memcpy", "sync", "idle"}
    op = fused[(fused.kind == "range") & (fused.label == "rlkernel:op.logp.forward")]
    assert list(op.lane) == [1]  # nested one level under the repetition
    ops = fused[fused.kind.isin(["kernel", "memset", "memcpy"])]
    busy = d.set_index(["range", "start_ns"]).loc[("rlkernel:logp-fused", fused.start_ns.min()), "gpu_busy_ns"]
    assert (ops.end_ns - ops.start_ns).sum() == busy  # these ops do not overlap: their sum is the busy time
    idle = fused[fused.kind == "idle"]
    assert (idle.end_ns - idle.start_ns).sum() + busy == ops.end_ns.max() - ops.start_ns.min()


def test_the_report_draws_one_svg_per_workload_without_script(tmp_path):
    out = tmp_path / "out"
    assert analyze.main([str(CASE), "--out", str(out)]) == 0
    html = (out / "report.html").read_text()
    section = html.split("Timeline of a steady-state repetition", 1)[1].split("</section>", 1)[0]
    assert section.count("<svg") == 3  # logp-native, logp-fused, logp-fused-bwd
    assert re.search(r'class="tl-sync"><title>cudaStreamSynchronize_v3020 \(cuda_api_sync\): ', section)
    assert 'class="tl-idle"><title>GPU idle: ' in section
    assert re.search(r'class="tl-kernel"><title>rlkernel_logp_fwd_kernel: ', section)
    assert "<script" not in html.lower() and "href=\"http" not in html


def test_first_calls_are_shown_apart(res, tmp_path):
    fc = res.first_calls.set_index("range").loc["rlkernel:op.logp.forward"]
    # The first forward call loads the module: hundreds of ms of span, while later calls take microseconds.
    assert fc.first_proj_ns > 100_000_000 and fc.steady_med_proj_ns < 1_000_000
    out = tmp_path / "out"
    assert analyze.main([str(CASE), "--out", str(out)]) == 0
    html = (out / "report.html").read_text()
    assert "First call apart from the steady state" in html.split("Where GPU time goes", 1)[1]
