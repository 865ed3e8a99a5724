"""python -m pipelines.analyze end to end on real fixtures: outputs, exit codes, bad input, defaults."""
from __future__ import annotations

import csv
import json
import pathlib
import shutil
import sqlite3
import subprocess
import sys

import pytest

from pipelines import analysis, analyze, inputs, trace_db
from tests.nsys_reference import DATA

pytestmark = pytest.mark.smoke
ROOT = pathlib.Path(__file__).resolve().parent.parent


def main(*argv):
    return analyze.main([str(a) for a in argv])


def header(path):
    with open(path, newline="") as f:
        return next(csv.reader(f))


def test_outputs_have_the_exact_columns(tmp_path):
    out = tmp_path / "rep"
    assert main(DATA / "verdicts", "--out", out) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["bandwidth.csv", "dispatch.csv", "gaps.csv", "kernel_summary.csv", "range_kernels.csv",
                     "range_summary.csv", "repetition_gaps.csv", "report.html", "utilization.csv"]
    for name, cols in analysis.COLUMNS.items():
        assert header(out / f"{name}.csv") == cols, name
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary file left behind


def test_bandwidth_uses_manifest_bytes_and_the_gpu_peak(tmp_path):
    out = tmp_path / "rep"
    main(DATA / "verdicts", "--out", out)
    rows = {r["workload"]: r for r in csv.DictReader(open(out / "bandwidth.csv"))}
    m = json.loads((DATA / "verdicts" / "manifest.json").read_text())
    r = rows["logp-native"]
    assert int(r["bytes"]) == next(w["bytes"] for w in m["workloads"] if w["name"] == "logp-native")
    # bytes per ns is GB/s; the peak is TARGET_INFO_GPU.memoryBandwidth (bytes/s) of the H200 that ran it.
    assert abs(float(r["gb_per_s"]) - int(r["bytes"]) / float(r["mean_gpu_busy_ns"])) < 0.01  # busy, not span
    assert float(r["peak_gb_per_s"]) == pytest.approx(4814.3, abs=0.1)


def test_require_fused_exits_1_after_writing(tmp_path, capsys):
    out = tmp_path / "rep"
    assert main(DATA / "verdicts", "--out", out, "--require-fused") == 1
    assert (out / "report.html").is_file()
    err = capsys.readouterr().err
    assert "not fused: workload rlkernel:logp-fused #1: fallback" in err
    assert main(DATA / "nvtx_mix", "--out", tmp_path / "mix", "--require-fused") == 0


def _bad(tmp_path, capsys, *argv):
    out = tmp_path / "never"
    rc = main(*argv, "--out", out)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and not out.exists()
    assert len(err) == 1 and err[0].startswith("pipelines.analyze: "), err
    return err[0]


def test_missing_file(tmp_path, capsys):
    assert "nope.sqlite: no such file" in _bad(tmp_path, capsys, tmp_path / "nope.sqlite")


def test_not_sqlite(tmp_path, capsys):
    p = tmp_path / "notes.sqlite"
    p.write_text("hello")
    assert "notes.sqlite: not an SQLite database" in _bad(tmp_path, capsys, p)


def test_truncated_sqlite(tmp_path, capsys):
    p = tmp_path / "cut.sqlite"
    data = (DATA / "nvtx_mix" / "trace.sqlite").read_bytes()
    p.write_bytes(data[: len(data) // 2])
    assert "cut.sqlite: truncated SQLite file" in _bad(tmp_path, capsys, p)


def test_corrupt_sqlite(tmp_path, capsys):
    p = tmp_path / "corrupt.sqlite"
    data = bytearray((DATA / "nvtx_mix" / "trace.sqlite").read_bytes())
    data[100:len(data)] = b"\xa5" * (len(data) - 100)  # header intact, every page garbage
    p.write_bytes(bytes(data))
    assert "corrupt.sqlite: " in _bad(tmp_path, capsys, p)


def test_sqlite_that_is_not_an_nsys_export(tmp_path, capsys):
    p = tmp_path / "plain.sqlite"
    con = sqlite3.connect(p)
    con.execute("CREATE TABLE t (x)")
    con.commit()
    con.close()
    assert "plain.sqlite: not an nsys export" in _bad(tmp_path, capsys, p)


def test_run_without_trace(tmp_path, capsys):
    run = tmp_path / "20260101T000000Z-logp-fused"
    run.mkdir()
    (run / "manifest.json").write_text(json.dumps({"workloads": [], "status": "failed", "error": "nsys died"}))
    msg = _bad(tmp_path, capsys, run)
    assert "run directory without a trace" in msg and "nsys died" in msg


def test_bad_manifest(tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(DATA / "verdicts", run)
    (run / "manifest.json").write_text("{not json")
    assert "manifest.json: not a readable JSON manifest" in _bad(tmp_path, capsys, run)


def test_nsys_rep_says_how_to_export(tmp_path, capsys):
    p = tmp_path / "x.nsys-rep"
    p.write_bytes(b"\0")
    assert "nsys export --type sqlite" in _bad(tmp_path, capsys, p)


def test_bad_threshold_and_unknown_option(tmp_path, capsys):
    base = ("--compare", DATA / "nvtx_mix")
    for value in ("-1", "nan", "inf"):
        assert "--threshold must be a finite number >= 0" in _bad(tmp_path, capsys, DATA / "nvtx_mix", *base,
                                                                  "--threshold", value)
    assert "unrecognized arguments: --no-such-option" in _bad(tmp_path, capsys, "--no-such-option")
    assert "invalid float value" in _bad(tmp_path, capsys, "--threshold", "abc")


def test_comparison_options_without_compare_are_refused(tmp_path, capsys):
    """--threshold and --force tune --compare: alone they would be ignored without a word."""
    for extra in (("--force",), ("--threshold", "3")):
        assert "go with --compare BASELINE" in _bad(tmp_path, capsys, DATA / "nvtx_mix", *extra)


def test_unknown_option_in_a_process_is_one_line_exit_2():
    r = subprocess.run([sys.executable, "-m", "pipelines.analyze", "--bogus"], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == ["pipelines.analyze: unrecognized arguments: --bogus (see --help)"]


def test_help_starts_without_torch():
    # rlkernel.cli (the exit codes) is torch-free; importing torch costs seconds the analyzer of a bare trace
    # should not pay
    code = ("import sys\nfrom pipelines import analyze\ntry:\n    analyze.main(['--help'])\n"
            "except SystemExit:\n    pass\nprint('TORCH-LOADED' if 'torch' in sys.modules else 'TORCH-FREE')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "TORCH-FREE"


@pytest.mark.parametrize("manifest, words", [
    ({"workloads": [{}]}, "workloads[0] has no name"),
    ([1], "a JSON list, not an object"),
    ({"workloads": [1]}, "workloads[0] is not an object"),
    ({"workloads": {"name": "x"}}, "workloads is not a list"),
    ({"workloads": [{"name": "logp-native", "bytes": "x"}]}, "workloads[0].bytes is 'x'"),
    ({"workloads": [{"name": "logp-native", "bytes": -1}]}, "workloads[0].bytes is -1"),
    ({"workloads": [{"name": "logp-native", "flops": 1.5}]}, "workloads[0].flops is 1.5"),
    ({"workloads": [{"name": "logp-fused", "fused_ops": "logp.forward"}]}, "fused_ops is not a list of strings"),
    ({"dispatch": 5}, "dispatch is not a list"),
    ({"dispatch": [{"op": 1, "status": "native"}]}, "dispatch[0] is not a record"),
    ({"node": []}, "node is not an object"),
    ({"node": {"devices": [{"index": "0"}]}}, "node.devices"),
    ({"command": "python x"}, "command is not a list"),
    ({"node": {"extension": {"archs": 5, "built": True}}}, "node.extension"),
    ({"schema": 2}, "schema 2"),
])
def test_malformed_manifest_is_one_line_exit_2(tmp_path, capsys, manifest, words):
    run = tmp_path / "run"
    shutil.copytree(DATA / "verdicts", run)
    (run / "manifest.json").write_text(json.dumps(manifest))
    msg = _bad(tmp_path, capsys, run)
    assert "manifest.json: not a run manifest" in msg and words in msg, msg


def test_corrupt_recorded_json_is_one_line_exit_2(tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(DATA / "verdicts", run)
    (run / "recorded.json").write_text("{cut")
    assert "recorded.json: not a readable JSON provenance record" in _bad(tmp_path, capsys, run)
    (run / "recorded.json").write_text("[1, 2]")
    assert "recorded.json: not a provenance record" in _bad(tmp_path, capsys, run)


def test_out_that_is_a_file_is_one_line_exit_2(tmp_path, capsys):
    f = tmp_path / "taken"
    f.write_text("mine")
    assert main(DATA / "nvtx_mix", "--out", f) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "taken: exists and is not a directory" in err[0], err
    assert f.read_text() == "mine"
    assert main(DATA / "nvtx_mix", "--out", f / "sub") == 2
    assert "is not a directory" in capsys.readouterr().err


def test_out_holding_other_files_is_never_replaced(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    assert main(DATA / "nvtx_mix", "--out", out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "entries the analyzer did not write (notes.txt)" in err[0], err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_stale_outputs_of_an_earlier_run_do_not_survive(tmp_path):
    out = tmp_path / "rep"
    assert main(DATA / "verdicts", "--compare", DATA / "verdicts", "--out", out) == 0
    assert (out / "compare.csv").is_file()
    assert main(DATA / "nvtx_mix", "--out", out) == 0
    names = sorted(p.name for p in out.iterdir())
    assert "compare.csv" not in names and "bandwidth.csv" not in names  # nvtx_mix has no manifest
    assert names == ["dispatch.csv", "gaps.csv", "kernel_summary.csv", "range_kernels.csv", "range_summary.csv",
                     "repetition_gaps.csv", "report.html", "utilization.csv"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rep"]  # no temporary sibling left


def test_a_failed_write_leaves_the_previous_set_whole(tmp_path, capsys, monkeypatch):
    out = tmp_path / "rep"
    assert main(DATA / "verdicts", "--out", out) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real, calls = pathlib.Path.write_bytes, []

    def flaky(self, data):
        calls.append(self.name)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(pathlib.Path, "write_bytes", flaky)
    assert main(DATA / "nvtx_mix", "--out", out) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if not ln.startswith("analyze: ")]  # progress
    assert len(err) == 1 and "cannot write the report (No space left on device)" in err[0], err
    assert "Traceback" not in err[0]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rep"]


def test_two_inputs_with_one_output_directory_are_refused(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        shutil.copy(DATA / "nvtx_mix" / "trace.sqlite", d / "trace.sqlite")
    assert "same directory" in _bad(tmp_path, capsys, a / "trace.sqlite", b / "trace.sqlite")


def test_missing_extension_is_blocked_with_the_install_line(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "duckdb_extension_sqlite_scanner" else real(name, *a))
    assert main(DATA / "nvtx_mix", "--out", tmp_path / "x") == 3
    err = capsys.readouterr().err
    assert f"pip install duckdb-extension-sqlite-scanner=={trace_db.duckdb.__version__}" in err
    assert not (tmp_path / "x").exists()


def test_exit_codes_are_defined_once():
    import pipelines
    from pipelines import capture
    from rlkernel import cli

    assert not [n for n in dir(pipelines) if n.startswith("EXIT_")]  # no copy of rlkernel.cli's constants
    for mod in (analyze, capture):
        assert (mod.EXIT_OK, mod.EXIT_CHECK_FAILED, mod.EXIT_USAGE, mod.EXIT_BLOCKED) == (
            cli.EXIT_OK, cli.EXIT_CHECK_FAILED, cli.EXIT_USAGE, cli.EXIT_BLOCKED)


def test_help_is_true(capsys):
    with pytest.raises(SystemExit) as e:
        main("--help")
    assert e.value.code == 0
    text = capsys.readouterr().out
    for opt in ("--out", "--fused-pattern", "--range", "--require-fused", "--compare", "--threshold"):
        assert opt in text
    for name in analysis.COLUMNS:
        assert name in text or name == "bandwidth"  # bandwidth.csv is named as conditional output
    assert "bandwidth.csv" in text


def test_default_input_is_the_newest_complete_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs = tmp_path / "runs"
    shutil.copytree(DATA / "nvtx_mix", runs / "20260101T000000Z-old")
    shutil.copytree(DATA / "verdicts", runs / "20260102T000000Z-new")
    shutil.copytree(DATA / "no_cuda", runs / "20260103T000000Z-newer-failed")
    (runs / ".20260104T000000Z-building.tmp-1").mkdir()
    # a failed run of the same second (the collision suffix hides "-failed") and a run without a manifest
    failed = runs / "20260105T000000Z-logp-fused-failed.2"
    shutil.copytree(DATA / "verdicts", failed)
    m = json.loads((failed / "manifest.json").read_text())
    (failed / "manifest.json").write_text(json.dumps(dict(m, status="failed", error="nsys export died")))
    shutil.copytree(DATA / "no_nvtx", runs / "20260106T000000Z-no-manifest")
    assert inputs.newest_run(runs) == runs / "20260102T000000Z-new"
    assert main() == 0
    assert (runs / "20260102T000000Z-new" / "report" / "dispatch.csv").is_file()
    assert not (runs / "20260101T000000Z-old" / "report").exists()


def test_default_input_without_runs_is_the_bundled_example(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert (inputs.EXAMPLE_DIR / "trace.sqlite").is_file(), "the bundled example trace is missing"
    assert main() == 0
    out = tmp_path / "reports" / "example"
    html = (out / "report.html").read_text()
    assert "Recorded" in html and "H200" in html and "Example run" in html
    dispatch = csv.DictReader(open(out / "dispatch.csv"))
    verdicts = {r["range"]: r["verdict"] for r in dispatch if r["level"] == "workload"}
    # the example was captured with the extension built: its fused workloads ran rlkernel_* kernels only
    assert verdicts == {"rlkernel:logp-native": "native", "rlkernel:logp-fused": "fused",
                        "rlkernel:logp-fused-bwd": "fused"}
    bw = list(csv.DictReader(open(out / "bandwidth.csv")))
    assert {r["workload"] for r in bw} == {"logp-native", "logp-fused", "logp-fused-bwd"}
    assert all(float(r["gb_per_s"]) > 0 for r in bw)


def test_bandwidth_joins_the_runs_ncu_metrics(tmp_path):
    run = next((DATA / "capture").glob("*-logp-native+1"))  # a real H200 run captured with --tool all
    assert main(run, "--out", tmp_path / "o") == 0
    bw = list(csv.DictReader(open(tmp_path / "o" / "bandwidth.csv")))
    assert {r["workload"] for r in bw} == {"logp-native", "logp-fused"}
    assert all(float(r["ncu_dram_bytes"]) > 0 for r in bw)  # joined with the run's ncu.csv


def test_several_inputs_get_one_directory_each(tmp_path):
    assert main(DATA / "no_cuda", DATA / "no_nvtx", "--out", tmp_path / "o") == 0
    assert (tmp_path / "o" / "no_cuda" / "report.html").is_file()
    assert (tmp_path / "o" / "no_nvtx" / "kernel_summary.csv").is_file()


def _copy_trace(tmp_path, name, *sql):
    run = tmp_path / name
    shutil.copytree(DATA / "verdicts", run)
    con = sqlite3.connect(run / "trace.sqlite")
    for statement in sql:
        con.execute(statement)
    con.commit()
    con.close()
    return run


def test_compare_flags_a_slower_fused_workload(tmp_path, capsys):
    # Baseline: the same capture with the GPU timeline compressed 2x (every GPU op's start and end halved:
    # attribution follows the unchanged launch calls, projections halve) -> now is ~2x slower.
    base = _copy_trace(tmp_path, "base", *(f'UPDATE {t} SET start = start / 2, "end" = "end" / 2' for t in (
        "CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMSET")))  # this export has no memcpy table
    out = tmp_path / "cmp"
    assert main(DATA / "verdicts", "--compare", base, "--out", out) == 1
    rows = {(r["kind"], r["name"]): r for r in csv.DictReader(open(out / "compare.csv"))}
    grpo = rows[("workload", "rlkernel:grpo-step")]
    assert grpo["regression"] == "True" and float(grpo["delta_pct"]) > 5
    assert rows[("workload", "rlkernel:logp-native")]["regression"] == "False"  # native: not gated
    assert "regression: rlkernel:grpo-step" in capsys.readouterr().err
    assert main(DATA / "verdicts", "--compare", base, "--threshold", "100000", "--out", out) == 0


def test_compare_flags_a_lost_fused_verdict(tmp_path, capsys):
    cur = _copy_trace(tmp_path, "cur", "UPDATE StringIds SET value = replace(value, 'rlkernel_', 'aten_like_')")
    out = tmp_path / "cmp"
    # Renamed kernels are another kernel set: not comparable (exit 2) unless --force, which still gates.
    assert main(cur, "--compare", DATA / "verdicts", "--threshold", "100000", "--out", out) == 2
    assert main(cur, "--compare", DATA / "verdicts", "--threshold", "100000", "--force", "--out", out) == 1
    rows = {(r["kind"], r["name"]): r for r in csv.DictReader(open(out / "compare.csv"))}
    g = rows[("workload", "rlkernel:grpo-step")]
    assert (g["base_verdict"], g["cur_verdict"], g["regression"]) == ("fused", "fallback", "True")


def test_ctrl_c_is_one_line_and_exit_130(tmp_path, capsys, monkeypatch):
    """KeyboardInterrupt during the analysis (the signal stood in for: where it lands is a matter of timing):
    one line, no traceback, exit 130, no report folder."""
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(analyze, "run", interrupted)
    assert analyze.main([str(DATA / "verdicts"), "--out", str(tmp_path / "o")]) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"{analyze.PROG}: interrupted (Ctrl-C)"] and "Traceback" not in err
    assert not (tmp_path / "o").exists()
