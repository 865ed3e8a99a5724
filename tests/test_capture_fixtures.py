"""The H200 fixtures of `pipelines.capture -- CMD` (tests/data/capture_<case>/, made by tools/make_capture_fixtures.sh):
the phases and steps are in the traces, `--steps` kept only the asked steps, the analyzer agrees with `nsys stats` on
the phase ranges, and the torchrun export splits into its two ranks. Skipped until the fixtures are committed."""
from __future__ import annotations

import json
import pathlib

import pytest

from pipelines import capture_command

DATA = pathlib.Path(__file__).resolve().parent / "data"
CASES = ("trl", "torchrun", "steps")
LIMIT = 5 * 1024 * 1024
STANDARD = ["step", "rollout", "old_logprob", "reference_logprob", "loss", "policy_forward", "backward", "optimizer"]


def folder(case: str) -> pathlib.Path:
    d = DATA / f"capture_{case}"
    if not (d / "trace.sqlite").exists():
        pytest.skip(f"{d.name} not committed yet (tools/make_capture_fixtures.sh on the GPU node)")
    return d


def manifest(case: str) -> dict:
    return json.loads((folder(case) / "manifest.json").read_text())


@pytest.mark.parametrize("case", CASES)
def test_fixture_is_small_stripped_and_lists_what_its_trace_holds(case):
    d = folder(case)
    assert all(p.stat().st_size < LIMIT for p in d.iterdir()), [p.name for p in d.iterdir()]
    m = manifest(case)
    assert m["status"] == "complete" and m["workloads"] == [] and m["target"]["exit_code"] == 0
    phases, steps = capture_command.phases_seen(d / "trace.sqlite")
    assert (phases, steps) == (m["target"]["phases"], m["target"]["step_indices"])
    assert "/home/" not in json.dumps(m) and "/root/" not in json.dumps(m["target"])


def test_trl_fixture_has_the_standard_phases_of_one_step():
    got = {p["name"]: p["instances"] for p in manifest("trl")["target"]["phases"]}
    assert sorted(got) == sorted(STANDARD) and got["step"] == 1
    assert manifest("trl")["target"]["step_indices"] == [[0, 0]]


def test_torchrun_fixture_is_one_export_of_two_ranks(tmp_path):
    pytest.importorskip("duckdb")
    from pipelines import analyze

    target = manifest("torchrun")["target"]
    assert {p["name"]: p["processes"] for p in target["phases"]}["step"] == 2
    assert analyze.main(["--ranks", str(folder("torchrun")), "--out", str(tmp_path / "ranks")]) == 0
    import csv

    with open(tmp_path / "ranks" / "ranks.csv") as f:
        assert len(list(csv.DictReader(f))) == 2  # each rank's process has GPU work: contract 10 splits them


def test_steps_fixture_holds_only_the_asked_steps():
    target = manifest("steps")["target"]
    assert target["steps"] == [5, 7] and target["step_indices"] == [[5, 7]]
    assert {p["name"]: p["instances"] for p in target["phases"]}["step"] == 3


@pytest.mark.parametrize("case", CASES)
def test_phase_ranges_equal_nsys_stats(case):
    pytest.importorskip("duckdb")
    import pandas as pd

    from pipelines import analysis

    d = folder(case)
    ref = pd.read_csv(d / "stats_nvtx_sum.csv")
    ref = ref[ref["Range"].str.startswith("rlkernel:phase:")]
    ours = analysis.analyze(analysis.Source(d / "trace.sqlite")).tables["range_summary"].set_index("range")
    assert len(ref) > 0
    for r in ref.itertuples(index=False):
        assert (ours.loc[r.Range, "instances"], ours.loc[r.Range, "range_total_ns"]) == (r.Instances, r[1]), r.Range
