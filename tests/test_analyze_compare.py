"""--compare per instance (issue 18, item 6): instance counts and median time per instance on both sides, a
comparability check (GPU model, workloads and shapes, kernel set) that exits 2 unless --force, the gate on the
median of fused workloads, compare.json for CI, and the baseline named in the report."""
from __future__ import annotations

import csv
import json
import shutil
import sqlite3

import pytest

from pipelines import analyze
from tests.nsys_reference import DATA

pytestmark = pytest.mark.smoke


def main(*argv):
    return analyze.main([str(a) for a in argv])


def variant(tmp_path, name, *statements, manifest=None):
    """A copy of the verdicts run directory with SQL applied to its trace and, optionally, its manifest edited."""
    run = tmp_path / name
    shutil.copytree(DATA / "verdicts", run)
    con = sqlite3.connect(run / "trace.sqlite")
    for s in statements:
        con.execute(s)
    con.commit()
    con.close()
    if manifest:
        m = json.loads((run / "manifest.json").read_text())
        manifest(m)
        (run / "manifest.json").write_text(json.dumps(m))
    return run


def rows(out):
    return {(r["kind"], r["name"]): r for r in csv.DictReader(open(out / "compare.csv"))}


# The baseline lacks the warm-up GEMM (outside every range): one instance fewer, the same time each.
FEWER_GEMMS = ("DELETE FROM CUPTI_ACTIVITY_KIND_KERNEL WHERE rowid = (SELECT k.rowid FROM "
               "CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s ON s.id = k.shortName WHERE s.value = 'Kernel2' "
               "ORDER BY k.start LIMIT 1)")


def test_kernels_compare_per_instance_not_in_total(tmp_path):
    base = variant(tmp_path, "base", FEWER_GEMMS)
    out = tmp_path / "cmp"
    assert main(DATA / "verdicts", "--compare", base, "--out", out) == 0
    gemm = next(r for (kind, name), r in rows(out).items() if kind == "kernel" and "cutlass" in name)
    assert int(gemm["base_instances"]) == int(gemm["cur_instances"]) - 1
    # Totals would read +50 % or more; the median per launch barely moves.
    assert abs(float(gemm["delta_pct"])) < 5 and gemm["regression"] == "False"
    doc = json.loads((out / "compare.json").read_text())
    assert doc["comparable"] is True and doc["reasons"] == [] and doc["regressions"] == 0
    k = next(k for k in doc["kernels"] if "cutlass" in k["name"])
    assert (k["base_instances"], k["cur_instances"]) == (int(gemm["base_instances"]), int(gemm["cur_instances"]))
    assert {"base_med_ns", "cur_med_ns", "delta_pct", "regression"} <= set(k)
    w = next(w for w in doc["workloads"] if w["name"] == "rlkernel:grpo-step")
    assert (w["base_instances"], w["cur_instances"], w["base_verdict"], w["cur_verdict"]) == (2, 2, "fused", "fused")
    assert doc["baseline"]["path"] == str(base) and doc["baseline"]["gpu"] == "NVIDIA H200"


def test_the_gate_reads_the_median_of_fused_workloads(tmp_path, capsys):
    # Baseline: every GPU op's times halved (launch calls unchanged): each repetition's busy time halves.
    base = variant(tmp_path, "base", *(f'UPDATE {t} SET start = start / 2, "end" = "end" / 2' for t in (
        "CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMSET")))
    out = tmp_path / "cmp"
    assert main(DATA / "verdicts", "--compare", base, "--out", out) == 1
    g = rows(out)[("workload", "rlkernel:grpo-step")]
    assert g["regression"] == "True" and float(g["cur_med_ns"]) == pytest.approx(2 * float(g["base_med_ns"]), 0.01)
    err = capsys.readouterr().err
    assert "regression: rlkernel:grpo-step: fused -> fused, median" in err and "per repetition" in err
    html = (out / "report.html").read_text()
    assert "Baseline: &lt;path&gt;/base" in html and str(tmp_path) not in html  # issue 29 item 23: no absolute path


@pytest.mark.parametrize("what, edit, manifest, words", [
    ("gpu", "UPDATE TARGET_INFO_GPU SET name = 'NVIDIA A100-SXM4-80GB'", None,
     "GPU NVIDIA A100-SXM4-80GB in the baseline"),
    ("shape", None, lambda m: m["workloads"][0]["shape"].update(batch_size=8), "shape of logp-fused differs"),
    ("workloads", None, lambda m: m["workloads"].pop(), "workloads differ (only now:"),
    ("kernels", "UPDATE StringIds SET value = replace(value, 'rlkernel_', 'aten_like_')", None, "kernel sets differ"),
])
def test_not_comparable_exits_2_unless_forced(tmp_path, capsys, what, edit, manifest, words):
    base = variant(tmp_path, "base", *([edit] if edit else []), manifest=manifest)
    out = tmp_path / "cmp"
    assert main(DATA / "verdicts", "--compare", base, "--out", out) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("pipelines.analyze:")]  # not progress
    assert len(err) == 1 and "not comparable with the baseline" in err[0] and words in err[0], err
    assert not out.exists()
    rc = main(DATA / "verdicts", "--compare", base, "--force", "--out", out)
    doc = json.loads((out / "compare.json").read_text())
    assert doc["comparable"] is False and doc["forced"] is True and any(words in r for r in doc["reasons"])
    assert "NOT COMPARABLE" in (out / "report.html").read_text()
    assert rc == 0  # the baseline changed, not this run: nothing regressed
