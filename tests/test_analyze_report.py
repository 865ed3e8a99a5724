"""report.html: escaping of trace strings, no environment, self-contained, empty traces, the compare view."""
from __future__ import annotations

import json
import re
import shutil
import sqlite3

import pytest

from pipelines import analyze, inputs
from tests.nsys_reference import DATA

pytestmark = pytest.mark.smoke
SECRET = "SECRET_TOKEN_4f9a"


def render(tmp_path, *inputs, extra=()):
    out = tmp_path / "out"
    rc = analyze.main([*map(str, inputs), "--out", str(out), *extra])
    return rc, out


def copy_case(tmp_path, case, *sql, params=()):
    run = tmp_path / case
    shutil.copytree(DATA / case, run)
    con = sqlite3.connect(run / "trace.sqlite")
    for s in sql:
        con.execute(s, params)
    con.commit()
    con.close()
    return run


def test_trace_strings_are_escaped(tmp_path):
    evil = '<script>alert("x")</script>&<b>'
    run = copy_case(tmp_path, "nvtx_mix", "UPDATE NVTX_EVENTS SET text = ? WHERE text = 'outer'", params=(evil,))
    rc, out = render(tmp_path, run)
    html = (out / "report.html").read_text()
    assert rc == 0
    assert "<script" not in html and "<b>" not in html
    assert "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;&amp;&lt;b&gt;" in html
    # Kernel names carry templates and `<unnamed>`: never raw in the page.
    assert "<unnamed>" not in html and "&lt;unnamed&gt;" in html
    assert "rlkernel_demo_fwd&lt;float, (int)4&gt;" in html


def test_no_environment_reaches_the_outputs(tmp_path):
    run = copy_case(
        tmp_path, "verdicts",
        f"INSERT INTO TARGET_INFO_SYSTEM_ENV (globalVid, devStateName, name, nameEnum, value) "
        f"VALUES (1, 'x', 'HF_TOKEN', 0, '{SECRET}')",
        f"INSERT INTO META_DATA_CAPTURE VALUES ('PROCESS_0:ENVIRONMENT_VARIABLE', 'HF_TOKEN=\"{SECRET}\"')")
    m = json.loads((run / "manifest.json").read_text())
    m["env"] = {"HF_TOKEN": SECRET, "CUDA_VISIBLE_DEVICES": "3"}
    m["node"] = {"driver": "580.159.04", "torch": "2.11.0+cu130", "python": "3.12", "cuda_runtime": "13.0",
                 "cuda_visible_devices": "3", "devices": [{"index": 0, "physical_index": 3, "uuid": "GPU-abc",
                                                           "name": "NVIDIA H200"}]}
    m["tools"] = {"nsys": {"path": "/opt/x/nsys", "version": "2025.3.1.0"}}
    (run / "manifest.json").write_text(json.dumps(m))
    rc, out = render(tmp_path, run)
    assert rc == 0
    for f in out.iterdir():
        assert SECRET not in f.read_text(), f.name
    html = (out / "report.html").read_text()
    assert "CUDA_VISIBLE_DEVICES" in html and "physical GPU 3" in html and "2025.3.1.0" in html
    assert "580.159.04" in html and "compute capability 9.0" in html


def test_only_the_projects_variables_reach_the_report(tmp_path):
    # issue 19 item 4: a manifest written before the allow-list was by name may hold any RLKERNEL_* variable
    run = copy_case(tmp_path, "verdicts")
    m = json.loads((run / "manifest.json").read_text())
    m["env"] = {"RLKERNEL_API_TOKEN": SECRET, "RLKERNEL_VALIDATE": "sync"}
    (run / "manifest.json").write_text(json.dumps(m))
    rc, out = render(tmp_path, run)
    html = (out / "report.html").read_text()
    assert rc == 0 and "RLKERNEL_VALIDATE" in html and "RLKERNEL_API_TOKEN" not in html and SECRET not in html


def test_report_is_self_contained(tmp_path):
    rc, out = render(tmp_path, DATA / "verdicts")
    html = (out / "report.html").read_text()
    assert re.search(r"<(link|script|img|iframe)\b", html) is None
    urls = set(re.findall(r"https?://[^\s\"'<>]+", html))
    assert urls <= {"http://www.w3.org/2000/svg"}  # the SVG namespace name, never fetched
    assert "<svg" in html and "<style>" in html
    for badge in ("v-fused", "v-fallback", "v-native"):
        assert f"badge {badge}" in html


def test_empty_traces_render(tmp_path):
    rc, out = render(tmp_path, DATA / "no_cuda")
    html = (out / "report.html").read_text()
    assert rc == 0 and "No kernels in this trace." in html and ":host_work" in html
    rc, out = render(tmp_path, DATA / "no_nvtx")
    html = (out / "report.html").read_text()
    assert rc == 0 and "No workload ranges in this trace" in html and "vectorized_elementwise_kernel" in html


def test_compare_report(tmp_path):
    cur = copy_case(tmp_path, "verdicts", "UPDATE StringIds SET value = replace(value, 'rlkernel_', 'aten_like_')")
    rc, out = render(tmp_path, cur, extra=["--compare", str(DATA / "verdicts"), "--force"])  # another kernel set
    html = (out / "report.html").read_text()
    assert rc == 1
    assert "Compared with the baseline" in html
    row = re.search(r"<tr>(?:(?!</tr>).)*rlkernel:grpo-step(?:(?!</tr>).)*</tr>", html.split("Compared with")[1], re.S)
    assert row and "v-fused" in row.group(0) and "v-fallback" in row.group(0) and ">yes<" in row.group(0)


def _row(html: str, section: str, first_cell: str) -> list[str]:
    """The cells' text of the row of ``section``'s table whose first cell is ``first_cell`` (tags dropped)."""
    part = html.split(f"<h2>{section}</h2>", 1)[1].split("</section>", 1)[0]
    for tr in re.findall(r"<tr>(.*?)</tr>", part, re.S):
        tds = [re.sub(r"<[^>]+>", "", td).strip() for td in re.findall(r"<td[^>]*>(.*?)</td>", tr, re.S)]
        if tds and tds[0] == first_cell:
            return tds
    raise AssertionError(f"no row {first_cell} in {section}")


def _heads(html: str, section: str) -> list[str]:
    part = html.split(f"<h2>{section}</h2>", 1)[1].split("</section>", 1)[0]
    return [t.split()[0] for t in re.findall(r'<th[^>]* title="([^"]*)"', part)]  # the CSV column names


def test_bundled_report_reads_in_units_with_shapes_ratios_and_reasons(tmp_path):
    """The bundled example as a person reads it (issue 40): a unit per column, times from t0, short kernel names,
    the shape, dtype, native/fused ratio and tokens/s on the workload rows, and why the alarming figures are low."""
    rc, out = render(tmp_path, inputs.EXAMPLE_DIR)
    html = (out / "report.html").read_text()
    assert rc == 0
    wl = dict(zip(_heads(html, "Workloads"), _row(html, "Workloads", "rlkernel:logp-fused"), strict=True))
    assert (wl["B"], wl["S"], wl["V"], wl["dtype"]) == ("2", "64", "4,096", "bfloat16")
    assert wl["native_over_fused"] == "17.6"  # 64,532.3 ns / 3,658.7 ns
    assert wl["tokens_per_s"] == "35.0" and "M tokens/s" in html  # 128 tokens / 3.6587 µs
    assert wl["mean_gpu_busy_ns"] == "3.66"  # µs, the column's unit
    assert "17.6× less GPU busy time than logp-native" in html
    # one unit per column, the raw ns in the tooltip; the first call's 294,636,793 ns read as 295 ms
    first = _row(html, "First call apart from the steady state", "rlkernel:op.logp.forward")
    assert first[2] == "295" and 'title="294,636,793"' in html
    # timestamps from t0 (the earliest in the tables: the first GPU operation), not the trace's raw clock
    disp = _row(html, "Dispatch verdicts per range instance", "op")
    assert disp[3] == "48.268" and "7,154,175,913" not in re.sub(r'title="[^"]*"', "", html)
    # pids without separators; booleans as yes/no; kernels by their short name, the demangled one on demand
    assert _row(html, "GPU utilisation", "6220")[0] == "6220" and ">False<" not in html
    assert "<details><summary>distribution_elementwise_grid_stride_kernel</summary>" in html
    # the alarming figures say why
    bw = _row(html, "Bandwidth", "logp-fused")
    assert bw[-1].startswith("latency-bound shape: at peak bandwidth its 1.05 MB move in 218 ns")
    util = _row(html, "GPU utilisation", "6220")[-1]
    assert util.startswith("low, as expected of a short capture: 97 % of the 360 ms span is 23 idle gaps")
    assert "the first call of rlkernel:op.logp.forward took 295 ms" in util
    # the timelines on one scale, their range names never cut
    section = html.split("Timeline of a steady-state repetition", 1)[1].split("</section>", 1)[0]
    assert "share one time scale: 829 µs across" in section and "…" not in section
    assert section.count(">op.logp.forward<") + section.count(">rlkernel:op.logp.forward<") == 3


def test_a_run_without_a_manifest_pairs_fused_and_native_by_name(tmp_path):
    trace = tmp_path / "bare.sqlite"
    shutil.copy(inputs.EXAMPLE_DIR / "trace.sqlite", trace)
    rc, out = render(tmp_path, trace)
    html = (out / "report.html").read_text()
    assert rc == 0 and "<th title=\"B\">" not in html and "<th class=\"n\" title=\"B\">" not in html
    wl = dict(zip(_heads(html, "Workloads"), _row(html, "Workloads", "rlkernel:logp-fused"), strict=True))
    assert wl["native_over_fused"] == "17.6" and "tokens_per_s" not in wl  # no shape: no tokens
