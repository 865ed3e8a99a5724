"""Verdicts on a real H200 trace of the project's range shapes (tools/traces/verdicts.py): a -fused workload
running ATen (fallback) next to one running the rlkernel_ kernel (fused), a native workload, op ranges inside
a training-step range with its GEMM and a native sampler, and a bare `-fused` range of another program."""
from __future__ import annotations

import json

import pytest

from pipelines import analysis
from tests.nsys_reference import DATA

pytestmark = pytest.mark.smoke
CASE = DATA / "verdicts"


def run(manifest=True, **kw):
    m = json.loads((CASE / "manifest.json").read_text()) if manifest else None
    return analysis.analyze(analysis.Source(CASE / "trace.sqlite", CASE, m), **kw)


def rows(res):
    d = res.tables["dispatch"]
    return [(r.level, r.range, int(r.instance), r.verdict, int(r.fused_kernels), int(r.other_kernels))
            for r in d.itertuples(index=False)]


EXPECTED = [
    ("workload", "rlkernel:logp-fused", 1, "fallback", 0, 2),
    ("op", "rlkernel:op.logp.forward", 1, "fallback", 0, 2),
    ("workload", "rlkernel:logp-fused", 2, "fused", 1, 0),
    ("op", "rlkernel:op.logp.forward", 2, "fused", 1, 0),
    ("workload", "rlkernel:logp-native", 1, "native", 0, 2),
    ("op", "rlkernel:op.logp.forward", 3, "native", 0, 2),
    # grpo-step: fused although its GEMM and the native sampler run ATen kernels.
    ("workload", "rlkernel:grpo-step", 1, "fused", 2, 17),
    ("op", "rlkernel:op.logp.forward", 4, "fused", 1, 0),
    ("op", "rlkernel:op.logp.backward", 1, "fused", 1, 0),
    ("op", "rlkernel:op.sample", 1, "native", 0, 15),
    ("workload", "rlkernel:grpo-step", 2, "fused", 2, 17),
    ("op", "rlkernel:op.logp.forward", 5, "fused", 1, 0),
    ("op", "rlkernel:op.logp.backward", 2, "fused", 1, 0),
    ("op", "rlkernel:op.sample", 2, "native", 0, 15),
    ("workload", ":bare-fused", 1, "fallback", 0, 2),
]


def test_verdicts_with_the_run_manifest():
    res = run()
    assert rows(res) == EXPECTED
    wl = res.workloads.set_index("range")["verdict"].to_dict()
    assert wl == {":bare-fused": "fallback", "rlkernel:grpo-step": "fused", "rlkernel:logp-fused": "fallback",
                  "rlkernel:logp-native": "native"}
    assert analysis.failures(res) == [
        "workload rlkernel:logp-fused #1: fallback",
        "op rlkernel:op.logp.forward #1 in rlkernel:logp-fused #1: fallback",
        "workload :bare-fused #1: fallback"]


def test_dispatch_instances_are_numbered_in_start_order_with_projection():
    d = run().tables["dispatch"]
    for _, g in d.groupby("range"):
        assert list(g["instance"]) == list(range(1, len(g) + 1))
        assert list(g["start_ns"]) == sorted(g["start_ns"])
    assert (d.loc[d["verdict"] != "no-gpu-work", "proj_gpu_ns"] > 0).all()


def test_pattern_from_the_command_line_turns_aten_kernels_fused():
    """--fused-pattern adds to the registry's: matching every kernel makes every range fused, except the native
    workload, which is native by its registry/manifest record whatever its kernels are called."""
    d = run(patterns=["*"]).tables["dispatch"]
    native = d["range"] == "rlkernel:logp-native"
    assert set(d.loc[~native, "verdict"]) == {"fused"}
    assert set(d.loc[native & (d["level"] == "workload"), "verdict"]) == {"native"}


def test_fused_patterns_sources():
    """rlkernel's own glob always, the others added to it (a --fused-pattern never replaces it)."""
    assert analysis.fused_patterns(None, {}, set(), []) == ["rlkernel_*"]
    assert analysis.fused_patterns(None, {}, set(), ["liger*"]) == ["liger*", "rlkernel_*"]
    m = {"workloads": [{"name": "w", "fused_patterns": ["mine_*"]}]}
    assert analysis.fused_patterns(m, {}, set(), ["cli_*"]) == ["cli_*", "mine_*", "rlkernel_*"]
    known = {"w": {"fused_patterns": ["reg_*"]}}
    assert analysis.fused_patterns(None, known, {"w"}, []) == ["reg_*", "rlkernel_*"]


def test_a_cli_pattern_keeps_rlkernel_ops_fused(tmp_path):
    """--fused-pattern 'liger*' on a trace of rlkernel's fused ops: they stay fused (the glob once replaced
    rlkernel_*, and every rlkernel op range read fallback); an empty glob is a usage error."""
    from pipelines import analyze

    base = run().tables["dispatch"]
    with_cli = run(patterns=["liger*"]).tables["dispatch"]
    assert list(with_cli["verdict"]) == list(base["verdict"]) and "fused" in set(base["verdict"])
    assert analyze.main([str(DATA / "verdicts"), "--fused-pattern", "", "--out", str(tmp_path / "o")]) == 2
    assert not (tmp_path / "o").exists()


def test_range_option_judges_another_programs_range_on_its_own_kernels():
    res = analysis.analyze(analysis.Source(DATA / "nvtx_mix" / "trace.sqlite"), ranges=[":inner", "step"])
    wl = res.workloads.set_index("range")
    # :inner runs ATen/cuBLAS only and is not a -fused name -> native; app:step mixes ATen and rlkernel_.
    assert wl.loc[":inner", "verdict"] == "native"
    assert wl.loc["app:step", "verdict"] == "mixed"
    assert analysis.failures(res) == []  # neither must be fused


def test_native_on_purpose_comes_from_dispatch_records_outside_workloads():
    m = {"workloads": [], "dispatch": [{"op": "logp.forward", "status": "native"}]}
    assert analysis.native_ops(m) == ["logp.forward"]
    m["dispatch"].append({"op": "logp.forward", "status": "fallback"})
    assert analysis.native_ops(m) == []
