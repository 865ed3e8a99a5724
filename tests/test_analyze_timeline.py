"""The report's timeline and first calls (issue 18, item 5): per workload, its repetition with the median GPU busy
time as inline SVG (NVTX ranges as rows, kernels/copies/sets on the GPU row, syncs marked, idle time shaded, no
script); each op range's first call shown apart from its steady state."""
from __future__ import annotations

import json
import re

import pytest

from pipelines import analysis, analyze, timeline
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


def test_timelines_share_a_scale_unless_their_spans_are_far_apart(tmp_path):
    # the bundled example: 62.9 µs, 310 µs, 829 µs (within 25x): one scale, the longest span
    assert set(timeline.shared_scales({"a": 62_900, "b": 310_000, "c": 829_000}).values()) == {829_000}
    # zero_sync: a 68 ms training step beside ops of 73-370 µs: the ops share a scale of their own
    assert timeline.shared_scales({"step": 68_400_000, "f": 72_700, "bwd": 370_000, "s": 97_200}) == {
        "step": 68_400_000, "f": 370_000, "bwd": 370_000, "s": 370_000}
    out = tmp_path / "out"
    assert analyze.main([str(DATA / "zero_sync"), "--out", str(out)]) == 0
    section = (out / "report.html").read_text().split("Timeline of a steady-state repetition", 1)[1]
    assert "<strong>2 time scales</strong> (68.4 ms, 370 µs across)" in section
    assert section.count("drawn on the 370 µs scale") == 3


def test_a_range_name_is_placed_whole_or_not_at_all():
    box = {"x": 300.0, "y": 20, "w": 20.0, "h": 13, "cls": "tl-range", "title": "", "label": "rlkernel:op.logp.forward"}
    wide = {**box, "x": 240.0, "w": 640.0, "label": "rlkernel:logp-native", "y": 4}
    labels = timeline.place_labels([box, wide])
    assert {lab["text"] for lab in labels} == {"rlkernel:op.logp.forward", "rlkernel:logp-native"}
    assert next(lab for lab in labels if lab["text"] == "rlkernel:logp-native")["x"] == 243.0  # inside its box
    assert next(lab for lab in labels if lab["text"].endswith("forward"))["x"] == 323.0  # right of its box
    # hemmed in by neighbours on its row: the short form, then nothing (its tooltip still names it); never cut
    left = {**box, "x": timeline.PLOT_X0 + 1, "w": 60.0, "label": "rlkernel:a"}
    right = {**box, "x": 330.0, "w": 500.0, "label": "rlkernel:b"}
    texts = [lab["text"] for lab in timeline.place_labels([left, box, right])]
    assert "rlkernel:op.logp.forward" not in texts and not any("…" in t for t in texts)
