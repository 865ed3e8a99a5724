"""The profile suite (issue 5): the guide's first command on a CPU, every column, statuses, writers, OOM, flags."""
from __future__ import annotations

import csv
import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

import rlkernel
from rlkernel import env, workloads
from rlkernel.profiling import cli, suite, writers
from rlkernel.profiling.rows import COLUMNS, SMOKE_NOTE, git_commit
from rlkernel.profiling.timing import quantile, summarize
from tests.subprocess_env import pythonpath

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "run_profile_suite.py"
# The hardware-profiling guide's smoke command, with --device cpu for this machine (output dir appended per test).
GUIDE_SMOKE = ["--device", "cpu", "--dtype", "float32", "--batch-sizes", "2", "--seq-lens", "16", "--vocab-sizes",
               "1024", "--workloads", "logp-native,logp-fused,sampling-native", "--warmup", "0", "--repeat", "1"]
STEM = re.compile(r"^profile_\d{8}T\d{6}_\d{6}Z$")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _reports(folder: Path) -> dict[str, list[Path]]:
    files = sorted(folder.iterdir())
    return {s: [f for f in files if f.suffix == s] for s in (".csv", ".json")} | {"all": files}


def _load(folder: Path) -> tuple[list[dict], dict]:
    found = _reports(folder)
    (csv_path,), (json_path,) = found[".csv"], found[".json"]
    assert csv_path.stem == json_path.stem and STEM.match(csv_path.stem)
    with open(csv_path, newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == COLUMNS
        csv_rows = list(reader)
    doc = json.loads(json_path.read_text())
    assert [tuple(r) for r in doc["rows"]] == [COLUMNS] * len(doc["rows"])
    # CSV and JSON carry the same values (CSV: text, empty for null)
    assert csv_rows == [{k: "" if r[k] is None else str(r[k]) for k in COLUMNS} for r in doc["rows"]]
    return doc["rows"], doc


def _check_common(row: dict, command: str) -> None:
    dev, node = env.device_record(-1), env.describe()
    assert row["gpu_name"] == dev["name"] == "CPU" and row["gpu_backend"] == "cpu"
    assert row["gpu_architecture"] == dev["architecture"] and row["gpu_compute_capability"] is None
    assert row["gpu_device_index"] == -1 and row["gpu_physical_index"] is None
    assert (row["driver"], row["cuda_runtime"]) == (node["driver"], node["cuda_runtime"])
    assert (row["torch"], row["python"]) == (torch.__version__, node["python"])
    assert row["rlkernel_version"] == rlkernel.__version__
    assert row["git_commit"] == git_commit() and re.fullmatch(r"([0-9a-f]{40})?", row["git_commit"])
    assert row["command"] == command
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", row["timestamp"])
    assert (row["dtype"], row["warmup"], row["repeat"], row["temperature"]) == ("float32", 0, 1, 1.0)


def _check_pass(row: dict, w: workloads.Workload, shape: workloads.Shape) -> None:
    assert (row["status"], row["dispatch"]) == ("pass", "native")
    assert row["total_tokens"] == row["batch_size"] * row["seq_len"]
    assert row["bytes_moved"] == w.bytes_moved(shape, torch.float32) > 0
    lat = row["latency_ms"]
    assert lat > 0 and row["latency_p20_ms"] <= lat <= row["latency_p80_ms"]
    assert row["tokens_per_sec"] == pytest.approx(row["total_tokens"] / (lat / 1e3))
    assert row["achieved_gbps"] == pytest.approx(row["bytes_moved"] / (lat / 1e3) / 1e9)
    # no theoretical bandwidth and no allocator counters on a CPU: empty, and the notes say so
    assert row["pct_of_peak_bandwidth"] is None and "pct_of_peak_bandwidth empty" in row["notes"]
    assert row["peak_memory_bytes"] is None and "peak_memory_bytes empty" in row["notes"]
    assert SMOKE_NOTE in row["notes"]


@pytest.mark.smoke
def test_guide_smoke_command_on_cpu(tmp_path):
    """The guide's first command, run as written (device cpu) through the script: every column of every row."""
    argv = [str(SCRIPT), *GUIDE_SMOKE, "--output-dir", str(tmp_path), "--csv", "--json"]
    out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr and "[3/3]" in out.stderr  # a progress line per shape
    assert "3 rows: 1 blocked, 2 pass" in out.stdout  # the summary table
    rows, doc = _load(tmp_path)
    assert doc["report_version"] == "1.0" and doc["command"] == shlex.join(argv)
    assert doc["node"]["devices"] == env.describe()["devices"] and re.match(r"\d{4}-", doc["generated_at"])
    assert [r["workload"] for r in rows] == ["logp-native", "logp-fused", "sampling-native"]
    for row in rows:
        _check_common(row, shlex.join(argv))
    native, fused, sampling = rows
    _check_pass(native, workloads.get("logp-native"), workloads.Shape(2, 16, 1024))
    assert (native["op"], native["batch_size"], native["seq_len"], native["vocab_size"]) == ("logp", 2, 16, 1024)
    assert native["top_k"] is None and native["top_p"] is None  # log-probs take no top-k/top-p
    # the fused workload never runs on a CPU: blocked, with the registry's reason, and no numbers
    reason = workloads.fused_available(workloads.get("logp-fused"), "cpu", torch.float32)
    assert reason and (fused["status"], fused["dispatch"]) == ("blocked", "blocked") and reason in fused["notes"]
    assert all(fused[k] is None for k in ("latency_ms", "tokens_per_sec", "achieved_gbps", "peak_memory_bytes"))
    # sampling draws one token per row: seq_len 1 whatever --seq-lens said
    _check_pass(sampling, workloads.get("sampling-native"), workloads.Shape(2, 1, 1024))
    assert (sampling["op"], sampling["seq_len"], sampling["total_tokens"]) == ("sample", 1, 2)
    assert (sampling["top_k"], sampling["top_p"]) == (50, 0.9)


@pytest.mark.smoke
def test_two_runs_into_one_folder_write_new_files(tmp_path, capsys):
    args = ["--device", "cpu", "--smoke", "--workloads", "logp-native", "--output-dir", str(tmp_path)]
    assert cli.main(args) == 0
    first = {p: p.read_bytes() for p in tmp_path.iterdir()}
    assert cli.main(args) == 0
    files = _reports(tmp_path)
    assert len(files[".csv"]) == 2 and len(files[".json"]) == 2 and len(files["all"]) == 4  # no temp files left
    assert {p: p.read_bytes() for p in first} == first  # the first run's files are untouched
    assert len({p.stem for p in files["all"]}) == 2


@pytest.mark.smoke
@pytest.mark.parametrize("flag, suffix", [("--csv", ".csv"), ("--json", ".json")])
def test_one_writer_only(tmp_path, capsys, flag, suffix):
    assert cli.main(["--device", "cpu", "--smoke", "--workloads", "logp-native", "--output-dir", str(tmp_path),
                     flag, "--no-summary"]) == 0
    assert [p.suffix for p in tmp_path.iterdir()] == [suffix]
    assert "rows:" not in capsys.readouterr().out


@pytest.mark.smoke
def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    calls = []

    def fsync_then_fail(fd):
        calls.append(fd)
        if len(calls) == 2:  # the CSV is complete, the JSON fails: neither may appear
            raise OSError("disk full")

    monkeypatch.setattr(writers.os, "fsync", fsync_then_fail)
    with pytest.raises(OSError, match="disk full"):
        writers.write_reports(tmp_path, [], csv_out=True, json_out=True, command="x", node={}, generated_at="t")
    assert list(tmp_path.iterdir()) == []


def test_failed_link_of_the_second_file_leaves_nothing(tmp_path, monkeypatch):
    real_link, calls = os.link, []

    def link_then_fail(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # the CSV has its name, the JSON's link fails: the CSV's name must go again
            raise OSError("link failed")
        real_link(src, dst)

    monkeypatch.setattr(writers.os, "link", link_then_fail)
    with pytest.raises(OSError, match="link failed"):
        writers.write_reports(tmp_path, [], csv_out=True, json_out=True, command="x", node={}, generated_at="t")
    assert list(tmp_path.iterdir()) == []


def _patch_step(monkeypatch, name: str, step) -> None:
    w = workloads.get(name)
    monkeypatch.setitem(workloads.REGISTRY, name, dataclasses.replace(w, step=step))


@pytest.mark.smoke
@pytest.mark.parametrize("where", ["inputs", "run"])
def test_oom_row_frees_memory_and_the_next_shape_runs(tmp_path, monkeypatch, capsys, where):
    """A CPU cannot run out of device memory on demand: the allocation points raise torch's OOM error instead."""
    w = workloads.get("logp-native")
    held = []

    def build(shape, dtype, device, seed):
        # the previous rows' tensors (the oom row's among them) are gone before this shape allocates
        assert [ref() for ref in held] == [None] * len(held)
        inputs = w.build(shape, dtype, device, seed)
        held.append(weakref.ref(inputs["logits"]))
        if where == "inputs" and shape.vocab_size == 64:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")
        return inputs

    def step(inputs):
        out = w.step(inputs)
        if where == "run" and inputs["logits"].shape[-1] == 64:  # the op ran, then a later allocation fails
            workspace = torch.empty_like(inputs["logits"])  # noqa: F841 - held by the raising frame
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")
        return out

    monkeypatch.setitem(workloads.REGISTRY, "logp-native", dataclasses.replace(w, build=build, step=step))
    code = cli.main(["--device", "cpu", "--dtype", "float32", "--batch-sizes", "2", "--seq-lens", "4",
                     "--vocab-sizes", "32,64,128", "--workloads", "logp-native", "--warmup", "1", "--repeat", "2",
                     "--output-dir", str(tmp_path)])
    assert code == 0  # an oom row is not a failure
    rows, _ = _load(tmp_path)
    assert [(r["vocab_size"], r["status"]) for r in rows] == [(32, "pass"), (64, "oom"), (128, "pass")]
    oom = rows[1]
    assert oom["notes"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 64.00 GiB"
    assert oom["latency_ms"] is None and oom["peak_memory_bytes"] is None
    assert oom["dispatch"] == ("native" if where == "run" else "")  # what ran before the error
    assert SMOKE_NOTE not in rows[0]["notes"]  # repeat 2 is not the single-run smoke check
    assert [ref() for ref in held] == [None, None, None]  # every row's tensors, the oom row's included, are gone


@pytest.mark.smoke
def test_wrong_result_and_errors_are_fail_exit_1(tmp_path, monkeypatch, capsys):
    w = workloads.get("logp-native")
    monkeypatch.setitem(workloads.REGISTRY, "logp-wrong", dataclasses.replace(
        w, name="logp-wrong", compare=lambda inputs: "logp: max |fused - native| 0.5 at 3 (atol 0.0001, rtol 1e-05)"))

    def broken(inputs):
        raise ValueError("bad kernel launch\nsecond line")

    monkeypatch.setitem(workloads.REGISTRY, "logp-broken", dataclasses.replace(w, name="logp-broken", step=broken))
    code = cli.main(["--device", "cpu", "--smoke", "--workloads", "logp-native,logp-wrong,logp-broken",
                     "--output-dir", str(tmp_path), "--no-summary"])
    assert code == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == "run_profile_suite.py: 2 row(s) failed"
    rows, _ = _load(tmp_path)
    ok, wrong, broken_row = rows
    assert ok["status"] == "pass"
    assert wrong["status"] == "fail" and wrong["latency_ms"] is None  # a wrong result gets no number
    assert wrong["notes"] == ("check against native failed: "
                              "logp: max |fused - native| 0.5 at 3 (atol 0.0001, rtol 1e-05)")
    assert broken_row["status"] == "fail" and broken_row["notes"] == "ValueError: bad kernel launch"


@pytest.mark.smoke
def test_fallback_reads_pass_fallback_and_fails_require_fused(tmp_path, monkeypatch, capsys):
    """A fused workload that runs and falls back (as on a GPU without the extension) never claims fused.

    On a CPU the suite blocks fused workloads before running them; lifting that block here lets the real
    dispatcher run the fused workload with backend="auto" and record its fallback.
    """
    monkeypatch.setattr(suite, "blocked_reason", lambda w, cfg: None)
    base = ["--device", "cpu", "--smoke", "--workloads", "logp-fused", "--no-summary"]
    assert cli.main([*base, "--output-dir", str(tmp_path / "auto")]) == 0
    (row,), _ = _load(tmp_path / "auto")
    assert (row["status"], row["dispatch"]) == ("pass", "fallback")
    assert "fallback: logp.forward ran native (tensor on cpu)" in row["notes"]
    assert cli.main([*base, "--require-fused", "--output-dir", str(tmp_path / "strict")]) == 1
    assert "ran without the fused path" in capsys.readouterr().err
    (row,), _ = _load(tmp_path / "strict")
    assert "--require-fused: dispatch was fallback, not fused" in row["notes"]


@pytest.mark.smoke
def test_require_fused_where_fused_cannot_run_exits_3(tmp_path, capsys):
    code = cli.main(["--device", "cpu", "--smoke", "--workloads", "logp-native,logp-fused", "--require-fused",
                     "--output-dir", str(tmp_path), "--no-summary"])
    assert code == 3
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("run_profile_suite.py: --require-fused: fused path cannot run here: tensor on cpu")
    assert "python -m rlkernel.build" in err
    rows, _ = _load(tmp_path)  # the report still records what ran and what was blocked
    assert [(r["status"], r["dispatch"]) for r in rows] == [("pass", "native"), ("blocked", "blocked")]


@pytest.mark.smoke
def test_sampling_ignores_seq_lens(tmp_path, capsys):
    assert cli.main(["--device", "cpu", "--dtype", "float32", "--batch-sizes", "2,3", "--seq-lens", "4,8",
                     "--vocab-sizes", "32", "--workloads", "sampling-native", "--warmup", "0", "--repeat", "1",
                     "--top-k", "5", "--top-p", "0.5", "--output-dir", str(tmp_path), "--json"]) == 0
    (path,) = tmp_path.iterdir()
    rows = json.loads(path.read_text())["rows"]
    assert [(r["batch_size"], r["seq_len"], r["top_k"], r["top_p"]) for r in rows] == [(2, 1, 5, 0.5), (3, 1, 5, 0.5)]


@pytest.mark.smoke
@pytest.mark.parametrize("args, code, message", [
    (["--workloads", "logp-native,nope"], 2, "--workloads: unknown nope; known: logp-native"),
    (["--batch-sizes", "0"], 2, "expected positive integers"),
    (["--seq-lens", "4,x"], 2, "expected comma-separated integers"),
    (["--repeat", "0"], 2, "expected an integer >= 1"),
    (["--warmup", "-1"], 2, "expected an integer >= 0"),
    (["--seed", "99999999999999999999"], 2, "expected an integer that fits 64 bits"),
    (["--vocab-sizes", f"32,{2 ** 63}"], 2, "expected integers that fit 64 bits"),
    (["--top-p", "1.5"], 2, "--top-p must be in (0, 1]"),
    (["--temperature", "nan"], 2, "--temperature: temperature must be a finite number >= 0"),
    (["--temperature", "1e-310", "--workloads", "logp-native"], 2, "--temperature: temperature 1e-310 is too small"),
    (["--temperature", "1e39", "--workloads", "sampling-native"], 2, "--temperature: temperature 1e+39 is too large"),
    (["--temperature", "0", "--workloads", "logp-native"], 2, "applies only to sampling workloads"),
    (["--dtype", "float64"], 2, "invalid choice"),
    (["--smoke", "--repeat", "3"], 2, "--smoke sets --repeat"),
    (["--device", "tpu"], 2, "expected cpu, cuda or cuda:N"),
    (["--workloads", ""], 2, "--workloads: empty name"),
    pytest.param(["--device", "cuda"], 3, "no CUDA device here", marks=no_cuda),
])
def test_flag_errors_one_line_no_files(tmp_path, capsys, args, code, message):
    base = ([] if "--device" in args else ["--device", "cpu"]) + ([] if "--smoke" in args else ["--smoke"])
    assert cli.main([*base, *args, "--output-dir", str(tmp_path / "out")]) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("run_profile_suite.py: ") and message in err
    assert not (tmp_path / "out").exists()


@pytest.mark.smoke
def test_a_shape_whose_logits_overflow_64_bits_is_a_usage_error(tmp_path, capsys):
    # each size fits int64, their product does not: refused before any row (it was a failed row, exit 1)
    assert cli.main(["--device", "cpu", "--dtype", "float32", "--batch-sizes", "2", "--seq-lens", "1",
                     "--vocab-sizes", str(2 ** 62), "--workloads", "logp-native", "--warmup", "0", "--repeat", "1",
                     "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "logits are more bytes than 64 bits count" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.smoke
def test_output_dir_that_cannot_be_made_fails_before_running(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert cli.main(["--device", "cpu", "--smoke", "--output-dir", str(blocker / "out")]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "--output-dir" in captured.err and "[1/" not in captured.err


@pytest.mark.smoke
@no_cuda
def test_device_cuda_without_cuda_from_the_shell(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), "--device", "cuda", "--smoke", "--output-dir", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 3 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "no CUDA device here" in out.stderr


@pytest.mark.smoke
def test_help_lists_every_flag_of_the_issue():
    text = cli.parser().format_help()
    for flag in ("--device", "--dtype", "--batch-sizes", "--seq-lens", "--vocab-sizes", "--workloads", "--top-k",
                 "--top-p", "--temperature", "--seed", "--warmup", "--repeat", "--output-dir", "--csv", "--json",
                 "--smoke", "--require-fused", "--no-summary"):
        assert flag in text


@pytest.mark.gpu
@needs_cuda
def test_guide_smoke_command_on_cuda(tmp_path):
    """The guide's first command exactly as written: GPU columns filled, honest fused/fallback dispatch."""
    argv = [str(SCRIPT), "--device", "cuda", *GUIDE_SMOKE[2:], "--output-dir", str(tmp_path), "--csv", "--json"]
    out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    rows, _ = _load(tmp_path)
    dev = env.device_record(0)
    for row in rows:
        assert (row["gpu_name"], row["gpu_backend"], row["gpu_device_index"]) == (dev["name"], dev["backend"], 0)
        assert row["gpu_compute_capability"] == dev["compute_capability"] and row["gpu_physical_index"] is not None
        assert row["status"] == "pass" and row["latency_ms"] > 0 and row["peak_memory_bytes"] > 0
        bw = dev["memory_bandwidth_bytes_per_s"]
        if bw:
            assert row["pct_of_peak_bandwidth"] == pytest.approx(row["achieved_gbps"] * 1e9 / bw * 100)
        else:
            assert row["pct_of_peak_bandwidth"] is None and "pct_of_peak_bandwidth empty" in row["notes"]
    native, fused, sampling = rows
    assert native["dispatch"] == sampling["dispatch"] == "native"
    reason = workloads.fused_available(workloads.get("logp-fused"), "cuda", torch.float32)
    if reason is None:
        assert fused["dispatch"] == "fused"
    else:  # no extension here: it ran native and says so, never a fused claim
        assert fused["dispatch"] == "fallback" and reason in fused["notes"]


@pytest.mark.smoke
def test_quantiles_interpolate_like_numpy():
    assert quantile([5.0, 1.0, 3.0, 2.0, 4.0], 0.2) == pytest.approx(1.8)
    assert quantile([1.0, 2.0], 0.5) == 1.5
    stats = summarize([4.0, 1.0, 3.0, 2.0])
    assert (stats.median_ms, stats.samples) == (2.5, 4)
    assert (stats.p20_ms, stats.p80_ms) == (pytest.approx(1.6), pytest.approx(3.4))
    with pytest.raises(ValueError):
        quantile([], 0.5)


def test_ctrl_c_is_one_line_and_exit_130(tmp_path, capsys, monkeypatch):
    """KeyboardInterrupt during the suite (stood in for: where the signal lands is timing): one line, no
    traceback, exit 130, no report written."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run_suite", interrupted)
    assert cli.main(["--device", "cpu", "--smoke", "--workloads", "logp-native", "--output-dir", str(tmp_path)]) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].endswith("interrupted (Ctrl-C)") and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.smoke
def test_the_recorded_command_of_python_m_is_the_one_to_run_again(tmp_path):
    # python -m puts the module file's path in argv[0]: the rows name `python -m rlkernel.profiling ...` instead
    out = subprocess.run([sys.executable, "-m", "rlkernel.profiling", "--device", "cpu", "--smoke", "--workloads",
                          "logp-native", "--output-dir", str(tmp_path), "--json", "--no-summary"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": pythonpath()}, timeout=300)
    assert out.returncode == 0, out.stderr
    (path,) = tmp_path.glob("*.json")
    want = f"python -m rlkernel.profiling --device cpu --smoke --workloads logp-native --output-dir {tmp_path} " \
           "--json --no-summary"
    assert {r["command"] for r in json.loads(path.read_text())["rows"]} == {want}


@pytest.mark.smoke
def test_mixed_setting_rows_do_not_claim_the_flags_settings(tmp_path):
    # sampling-mixed-* cycles its own per-row grid: its row leaves top_k / top_p / temperature empty and says why
    assert cli.main(["--device", "cpu", "--smoke", "--workloads", "sampling-mixed-native,sampling-native",
                     "--top-k", "3", "--top-p", "0.2", "--temperature", "0.5", "--output-dir", str(tmp_path),
                     "--json", "--no-summary"]) == 0
    (path,) = tmp_path.glob("*.json")
    rows = {r["workload"]: r for r in json.loads(path.read_text())["rows"]}
    mixed, plain = rows["sampling-mixed-native"], rows["sampling-native"]
    assert (mixed["top_k"], mixed["top_p"], mixed["temperature"]) == (None, None, None)
    assert "the workload sets its own per row" in mixed["notes"]
    assert (plain["top_k"], plain["top_p"], plain["temperature"]) == (3, 0.2, 0.5)


@pytest.mark.smoke
def test_require_fused_fails_a_fused_row_that_ran_out_of_memory():
    # an oom row proves nothing: without --require-fused it is a row status, with it the run fails
    cfg = dataclasses.replace(cli.config(cli.parser().parse_args(["--device", "cpu", "--smoke", "--workloads",
                                                                  "logp-fused,logp-native"])), require_fused=True)
    rows = [{"workload": "logp-native", "status": "oom", "dispatch": ""},
            {"workload": "logp-fused", "status": "pass", "dispatch": "fused"}]
    assert suite.exit_status(rows, cfg) == "ok"  # a native row's oom is not the flag's business
    rows.append({"workload": "logp-fused", "status": "oom", "dispatch": ""})
    assert suite.exit_status(rows, cfg) == "failed"
    assert suite.exit_status(rows, dataclasses.replace(cfg, require_fused=False)) == "ok"
