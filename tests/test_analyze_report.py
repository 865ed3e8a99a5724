"""report.html: escaping of trace strings, no environment, self-contained, empty traces, the compare view."""
from __future__ import annotations

import json
import re
import shutil
import sqlite3

import pytest

from pipelines import analyze
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
    assert row and "v-fused" in row.group(0) and "v-fallback" in row.group(0) and "True" in row.group(0)
