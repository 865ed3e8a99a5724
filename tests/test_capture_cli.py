"""python -m pipelines.capture end to end on the CPU.

nsys and ncu cannot run here, so fakes stand in for them on a temporary PATH (the one edge a CPU test cannot
reach): they run the real child program, which runs the real workloads (on the CPU) and writes its real
dispatch history; the fake ncu prints ncu's real raw CSV from an H200 capture (tests/data/capture).
"""
import json
import os
import pathlib
import shutil
import signal
import stat
import subprocess
import sys
import time

import pytest
import torch

from pipelines import capture, capture_child, ncu_csv
from rlkernel.cli import EXIT_BLOCKED, EXIT_CHECK_FAILED, EXIT_OK, EXIT_USAGE
from rlkernel.dispatch import fused_unavailable_reason

DATA = pathlib.Path(__file__).parent / "data" / "capture"
RUN = DATA / "20261202T095005Z-logp-native+1"  # a real capture on the H200 (stripped), --tool all
SMALL = ["--batch-size", "2", "--seq-len", "4", "--vocab-size", "64", "--warmup", "1", "--repeat", "3",
         "--device", "cpu"]

FAKE_NSYS = f"""#!{sys.executable}
import os, signal, sqlite3, subprocess, sys
signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # ended, it exits 1 as a failed run would
a = sys.argv[1:]
if a == ["--version"]:
    print("NVIDIA Nsight Systems version 2099.1.1.1-fake")
    sys.exit(0)
if a[0] == "profile":
    base = a[a.index("-o") + 1]
    if os.environ.get("FAKE_NSYS_FAIL") or os.environ.get("FAKE_NSYS_FAIL_RANK", "-") == os.environ.get("RANK"):
        print("fake nsys: injected failure", file=sys.stderr)
        sys.exit(1)
    if os.environ.get("FAKE_NSYS_QDSTRM"):  # what nsys does when its importer cannot start
        open(base + ".qdstrm", "w").write("raw")
        sys.exit(0)
    child = a[a.index("--force-overwrite") + 2:]
    if os.environ.get("FAKE_NSYS_HANG_RANK", "-") == os.environ.get("RANK"):  # a rank that never gets going
        child = [sys.executable, "-c", "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); "
                 "time.sleep(600)", base + ".pid"]
    rc = subprocess.call(child)
    open(base + ".nsys-rep", "w").write("rep")
    sys.exit(rc)
if a[0] == "export":
    con = sqlite3.connect(a[a.index("--output") + 1])
    con.execute("CREATE TABLE fake(x)")
    con.commit()
    sys.exit(0)
sys.exit(9)
"""

FAKE_NCU = f"""#!{sys.executable}
import subprocess, sys
a = sys.argv[1:]
if a == ["--version"]:
    print("NVIDIA (R) Nsight Compute Command Line Profiler\\nVersion 2099.1.0.0 (build 1) (public-release)")
    sys.exit(0)
if a[0] == "--import":
    workload = open(a[1]).read()
    raw = open({str(DATA / "ncu_raw_logp-native.csv")!r}).read()
    print(raw.replace('"rlkernel:logp-native:', '"rlkernel:' + workload + ':'), end="")
    sys.exit(0)
include = a[a.index("--nvtx-include") + 1]
base = a[a.index("-o") + 1]
rc = subprocess.call(a[a.index("--force-overwrite") + 1:])
open(base + ".ncu-rep", "w").write(include.split("@")[1].rstrip("/"))
sys.exit(rc)
"""


@pytest.fixture
def fakes(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in (("nsys", FAKE_NSYS), ("ncu", FAKE_NCU)):
        p = bindir / name
        p.write_text(text)
        p.chmod(p.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    for var in ("NSYS", "NCU", "FAKE_NSYS_FAIL", "FAKE_NSYS_FAIL_RANK", "FAKE_NSYS_QDSTRM", "FAKE_NSYS_HANG_RANK"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def run_capture(out_dir, *extra):
    return capture.main(["--workload", "logp-native", "--workload", "logp-fused", *SMALL, "--output-dir",
                         str(out_dir), *extra])


def only_run(out_dir) -> pathlib.Path:
    entries = list(out_dir.iterdir())
    assert len(entries) == 1, entries  # one run, no temporary folder left behind
    return entries[0]


# ---- command lines ---------------------------------------------------------------------------------------

@pytest.mark.smoke
def test_command_lines():
    args = capture.build_parser().parse_args(["--workload", "logp-fused", *SMALL, "--top-p", "0.5"])
    child = capture.child_argv(args, ["logp-fused"], "rec.json")
    assert child[:3] == [sys.executable, "-m", "pipelines.capture_child"]
    back = capture_child.build_parser().parse_args(child[3:])
    assert (back.workload, back.batch_size, back.seq_len, back.vocab_size, back.top_p, back.repeat, back.warmup,
            back.device, back.record) == (["logp-fused"], 2, 4, 64, 0.5, 3, 1, "cpu", "rec.json")
    nsys = capture.nsys_profile_argv("/x/nsys", "run/trace", child)
    assert nsys[:8] == ["/x/nsys", "profile", "--trace=cuda,nvtx", "--sample=none", "--cpuctxsw=none",
                        "--cuda-graph-trace=node", "-o", "run/trace"] and nsys[-len(child):] == child
    assert capture.nsys_export_argv("/x/nsys", "r.nsys-rep", "r.sqlite") == [
        "/x/nsys", "export", "--type", "sqlite", "--force-overwrite", "true", "--output", "r.sqlite", "r.nsys-rep"]
    ncu = capture.ncu_profile_argv("/x/ncu", "logp-fused", "run/ncu-logp-fused", child)
    assert ncu[:6] == ["/x/ncu", "--nvtx", "--nvtx-include", "rlkernel@logp-fused/", "--clock-control", "none"]
    assert ncu[ncu.index("--metrics") + 1].split(",") == list(ncu_csv.METRICS)
    imp = capture.ncu_import_argv("/x/ncu", "a.ncu-rep")
    assert imp[imp.index("--page") + 1] == "raw" and imp[imp.index("--print-units") + 1] == "base"


@pytest.mark.smoke
@pytest.mark.parametrize("argv, words", [
    (["--workload", "nope"], "unknown workload"),
    ([], "--workload"),
    (["--workload", "logp-fused", "--repeat", "0"], "--repeat"),
    (["--workload", "logp-fused", "--top-p", "1.5"], "--top-p"),
    (["--workload", "logp-fused", "--temperature", "0"], "--temperature"),
    (["--workload", "logp-fused", "--tool", "perf"], "--tool"),
    (["--workload", "logp-fused", "--workload", "logp-fused"], "twice"),
    (["--workload", "logp-fused", "--temperature", "nan"], "--temperature"),
    (["--workload", "sampling-native", "--temperature", "nan"], "--temperature"),
    (["--workload", "logp-fused", "--temperature", "inf"], "--temperature"),
    (["--workload", "logp-fused", "--top-p", "nan"], "--top-p"),
    (["--workload", "logp-fused", "--bogus"], "unrecognized arguments: --bogus"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--workload", "logp-fused", "--seed", "99999999999999999999"], "--seed 99999999999999999999 does not fit"),
    (["--workload", "logp-fused", "--vocab-size", str(2 ** 63)], "--vocab-size 9223372036854775808 does not fit"),
    (["--workload", "logp-fused", "--seed", "-1"], "--seed must be >= 0"),
    (["--workload", "logp-fused", "--ncu", "/opt/ncu"], "--ncu and --keep-ncu-rep go with --tool ncu"),
    (["--workload", "logp-fused", "--keep-ncu-rep"], "--ncu and --keep-ncu-rep go with --tool ncu"),
    (["--workload", "logp-fused", "--ranks", "0"], "--ranks must be >= 1"),
    (["--workload", "logp-fused", "--ranks", "-2"], "--ranks must be >= 1"),
    (["--workload", "logp-fused", "--ranks", "two"], "--ranks"),
    (["--workload", "logp-fused", "--ranks", "2", "--tool", "ncu"], "--ranks traces with nsys only"),
    (["--workload", "logp-fused", "--ranks", "2", "--tool", "all"], "--ranks traces with nsys only"),
])
def test_bad_arguments_exit_2_with_one_line(argv, words, capsys):
    assert capture.main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and words in err


@pytest.mark.smoke
@pytest.mark.parametrize("where", ["file", "file/sub"])
def test_output_dir_that_is_a_file_exits_2_with_one_line(fakes, capsys, where):
    # issue 19 item 14: FileExistsError traceback and exit 1
    (fakes / "file").write_text("keep")
    assert run_capture(fakes / where) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pipelines.capture: --output-dir") and "not a directory" in err[0]
    assert (fakes / "file").read_text() == "keep"
    proc = subprocess.run([sys.executable, "-m", "pipelines.capture", "--workload", "logp-native", *SMALL,
                           "--output-dir", str(fakes / where)], capture_output=True, text=True)
    assert proc.returncode == EXIT_USAGE and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.smoke
def test_output_dir_that_cannot_be_created_exits_2_with_one_line(fakes, capsys):
    # /proc refuses new folders, even to root (where a read-only folder would not)
    assert run_capture("/proc/rlkernel-no-such/runs") == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()  # after the line naming the nsys found
    assert err[1:] == ["pipelines.capture: --output-dir /proc/rlkernel-no-such/runs: No such file or directory"]


@pytest.mark.smoke
def test_cli_process_exit_codes_and_help():
    bad = subprocess.run([sys.executable, "-m", "pipelines.capture", "--workload", "nope"], capture_output=True,
                         text=True)
    assert bad.returncode == EXIT_USAGE and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == [bad.stderr.strip()]
    out = subprocess.run([sys.executable, "-m", "pipelines.capture", "--help"], capture_output=True, text=True)
    assert out.returncode == EXIT_OK and "--require-fused" in out.stdout and "exit codes" in out.stdout
    # exit 1 as the contract defines it, and --require-fused's mapping of the analyzer's codes
    assert "1  a check you asked for failed" in out.stdout and "could not be analysed" in out.stdout
    bogus = subprocess.run([sys.executable, "-m", "pipelines.capture", "--bogus"], capture_output=True, text=True)
    assert bogus.returncode == EXIT_USAGE and bogus.stdout == ""
    assert bogus.stderr.strip().splitlines() == ["pipelines.capture: unrecognized arguments: --bogus (see --help)"]


@pytest.mark.smoke
def test_child_bad_arguments_are_one_line_exit_2(capsys):
    assert capture_child.main(["--bogus"]) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["pipelines.capture_child: unrecognized arguments: --bogus (see --help)"]


@pytest.mark.smoke
def test_no_nsys_exits_3_and_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("NSYS", raising=False)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setattr("pipelines.tools.OPT_ROOT", str(tmp_path / "opt"))
    assert run_capture(tmp_path / "runs") == EXIT_BLOCKED
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nsys not found" in err and "install Nsight Systems or pass --nsys" in err
    assert "node-kit" not in err  # a user has no project GPU-node kit
    assert not (tmp_path / "runs").exists()  # nothing started


@pytest.mark.smoke
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_no_cuda_exits_3(fakes, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU machine, also when run on a GPU node
    rc = capture.main(["--workload", "logp-fused", "--output-dir", str(fakes / "runs")])
    err = capsys.readouterr().err
    assert rc == EXIT_BLOCKED and "no CUDA device" in err and not (fakes / "runs").exists()


# ---- whole captures --------------------------------------------------------------------------------------

def test_capture_all_tools(fakes, monkeypatch, capsys):
    monkeypatch.setenv("RLKERNEL_ANALYZE_MEMORY", "2GB")  # one of the project's variables: kept
    monkeypatch.setenv("RLKERNEL_API_TOKEN", "must-not-leak")  # RLKERNEL_ but not the project's: dropped
    monkeypatch.setenv("SECRET_TOKEN", "must-not-leak")
    assert run_capture(fakes / "runs", "--tool", "all") == EXIT_OK
    out, err = capsys.readouterr()
    run = only_run(fakes / "runs")
    assert out.strip().splitlines()[-1] == str(run) and run.name.endswith("-logp-native+1")
    assert "[capture" in err and "nsys profile: exit 0" in err
    assert sorted(p.name for p in run.iterdir()) == ["child.stderr", "child.stdout", "manifest.json", "ncu.csv",
                                                     "tools.stderr", "tools.stdout", "trace.nsys-rep",
                                                     "trace.sqlite"]
    m = json.loads((run / "manifest.json").read_text())
    assert (m["schema"], m["status"], m["error"]) == (1, "complete", None)
    assert m["command"][1:5] == ["-m", "pipelines.capture", "--workload", "logp-native"]
    assert [w["name"] for w in m["workloads"]] == ["logp-native", "logp-fused"]
    assert m["workloads"][1]["fused_ops"] == ["logp.forward"] and m["workloads"][1]["repeat"] == 3
    assert m["tools"]["nsys"]["version"] == "2099.1.1.1-fake" and m["tools"]["ncu"]["version"] == "2099.1.0.0"
    assert [s["name"] for s in m["steps"]] == ["nsys profile", "nsys export", "ncu profile logp-native",
                                               "ncu import logp-native", "ncu profile logp-fused",
                                               "ncu import logp-fused"]
    assert all(s["exit_code"] == 0 and s["seconds"] >= 0 and s["command"] for s in m["steps"])
    # the traced child's own dispatch history: warm-up + repetitions; fused asked for, and fallen back because the
    # child runs on the CPU (SMALL's --device cpu), also on a GPU node
    disp = {(d["requested"], d["status"], d["reason"]): d["count"] for d in m["dispatch"]}
    why_not = fused_unavailable_reason("logp.forward", torch.device("cpu"), torch.bfloat16)
    assert disp == {("native", "native", ""): 4, ("auto", "fallback", why_not): 4}
    assert m["steps"][2]["dispatch"] == [{"op": "logp.forward", "requested": "native", "backend": "native",
                                          "status": "native", "reason": "", "count": 4}]
    assert m["env"].get("RLKERNEL_ANALYZE_MEMORY") == "2GB" and "must-not-leak" not in json.dumps(m)
    assert m["node"]["devices"][0]["backend"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert "pipelines.capture_child: logp-fused: 1 warm-up + 3 repetitions" in (run / "child.stdout").read_text()
    rows = list(csvrows(run / "ncu.csv"))
    assert rows[0] == list(ncu_csv.LONG_COLUMNS)
    assert {r[0] for r in rows[1:]} == {"logp-native", "logp-fused"} and len(rows) == 1 + 2 * 90 * 7


def csvrows(path):
    import csv

    with open(path) as f:
        yield from csv.reader(f)


def test_failed_profiler_leaves_a_failed_run(fakes, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_NSYS_FAIL", "1")
    assert run_capture(fakes / "runs") == EXIT_CHECK_FAILED
    run = only_run(fakes / "runs")
    assert run.name.endswith("-failed")
    m = json.loads((run / "manifest.json").read_text())
    assert m["status"] == "failed" and "nsys profile exited 1: fake nsys: injected failure" in m["error"]
    assert m["steps"][0]["exit_code"] == 1
    err = capsys.readouterr().err
    assert "run kept as" in err and "Traceback" not in err


def test_qdstrm_only_is_diagnosed(fakes, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_NSYS_QDSTRM", "1")
    assert run_capture(fakes / "runs") == EXIT_BLOCKED
    m = json.loads((only_run(fakes / "runs") / "manifest.json").read_text())
    assert "nsys left only trace.qdstrm" in m["error"] and "libdw.so.1" in m["error"]
    assert "only trace.qdstrm" in capsys.readouterr().err


def test_strict_fused_child_is_blocked(fakes, monkeypatch):
    monkeypatch.setenv("RLKERNEL_REQUIRE_FUSED", "1")  # the child refuses to fall back: no fused path on a CPU
    assert run_capture(fakes / "runs") == EXIT_BLOCKED
    m = json.loads((only_run(fakes / "runs") / "manifest.json").read_text())
    assert m["status"] == "failed" and "blocked" in m["error"] and "tensor on cpu" in m["error"]


def test_require_fused_without_the_analyzer_refuses_before_capturing(fakes, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "pipelines.analyze" else real(n, *a))
    assert run_capture(fakes / "runs", "--require-fused") == EXIT_BLOCKED
    assert "pipelines.analyze" in capsys.readouterr().err and not (fakes / "runs").exists()


def test_require_fused_verdict_on_a_real_h200_run(tmp_path):
    # logp-fused fell back (extension not built then): the analyzer's verdict must fail the check
    pytest.importorskip("duckdb")
    run = tmp_path / RUN.name
    shutil.copytree(RUN, run)
    manifest = json.loads((run / "manifest.json").read_text())
    rc, msg = capture.require_fused(run, manifest)
    assert rc == EXIT_CHECK_FAILED and "did not run fused" in msg
    step = json.loads((run / "manifest.json").read_text())["steps"][-1]
    assert (step["name"], step["exit_code"]) == ("analyze --require-fused", EXIT_CHECK_FAILED)


@pytest.mark.smoke
@pytest.mark.parametrize("analyzer_rc, line, want_rc, words", [
    (0, None, EXIT_OK, ""),
    (1, "not fused: workload rlkernel:logp-fused #1: fallback", EXIT_CHECK_FAILED, "did not run fused"),
    (2, "x/trace.sqlite: truncated SQLite file", EXIT_CHECK_FAILED,
     "the new trace could not be analysed: x/trace.sqlite: truncated SQLite file"),
    (3, "the DuckDB sqlite extension is missing: pip install it", EXIT_BLOCKED,
     "blocked on this machine: the DuckDB sqlite extension is missing"),
])
def test_require_fused_maps_the_analyzers_exit_codes(tmp_path, monkeypatch, analyzer_rc, line, want_rc, words):
    from pipelines import analyze

    # the analyzer's verdict function: its exit code and, for a 2 or 3, its reason (issue 34: no stderr scraping)
    monkeypatch.setattr(analyze, "verdict", lambda argv: (analyzer_rc, line if analyzer_rc in (2, 3) else ""))
    run = tmp_path / "run"
    run.mkdir()
    manifest = {"steps": []}
    rc, msg = capture.require_fused(run, manifest)
    assert rc == want_rc and words in msg
    step = json.loads((run / "manifest.json").read_text())["steps"][-1]
    assert step["exit_code"] == analyzer_rc  # the manifest keeps what the analyzer said


@pytest.mark.smoke
def test_require_fused_survives_an_analyzer_crash(tmp_path, monkeypatch):
    from pipelines import analyze

    def boom(argv):
        raise TypeError("unforeseen")

    monkeypatch.setattr(analyze, "verdict", boom)
    (tmp_path / "run").mkdir()
    rc, msg = capture.require_fused(tmp_path / "run", {"steps": []})
    assert rc == EXIT_CHECK_FAILED and "could not be analysed: TypeError: unforeseen" in msg


def test_require_fused_on_a_trace_the_analyzer_cannot_read_exits_1(fakes, capsys):
    # the fake nsys exports an SQLite file that is no nsys export: the analyzer's exit 2 is capture's 1
    pytest.importorskip("duckdb")
    assert run_capture(fakes / "runs", "--require-fused") == EXIT_CHECK_FAILED
    run = only_run(fakes / "runs")
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("pipelines.capture: --require-fused: the new trace could not be analysed: ")
    assert "not an nsys export" in last and f"run kept at {run}" in last
    m = json.loads((run / "manifest.json").read_text())
    assert m["status"] == "complete" and m["steps"][-1]["exit_code"] == EXIT_USAGE


# ---- --ranks: one process group, one trace per rank ------------------------------------------------------

def test_capture_ranks_two_gloo_processes_on_cpu(fakes, capsys):
    """Two real processes in one gloo group on the CPU (an all_reduce after each repetition), each under its own
    (fake) nsys: trace_rank<N> per rank, one manifest with each rank's dispatch, the layout analyze --ranks reads."""
    from pipelines import ranks

    assert run_capture(fakes / "runs", "--ranks", "2") == EXIT_OK
    run = only_run(fakes / "runs")
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(run)
    assert sorted(p.name for p in run.iterdir()) == [
        "child_rank0.stderr", "child_rank0.stdout", "child_rank1.stderr", "child_rank1.stdout", "manifest.json",
        "tools.stderr", "tools.stdout", "trace_rank0.nsys-rep", "trace_rank0.sqlite", "trace_rank1.nsys-rep",
        "trace_rank1.sqlite"]
    m = json.loads((run / "manifest.json").read_text())
    assert (m["status"], m["ranks"]) == ("complete", {"world_size": 2, "backend": "gloo"})
    assert [s["name"] for s in m["steps"]] == ["nsys profile rank 0", "nsys profile rank 1", "nsys export rank 0",
                                               "nsys export rank 1"]
    cmd = m["steps"][1]["command"]
    assert cmd[cmd.index("-o") + 1].endswith("/trace_rank1") and cmd[-2:] == ["--dist-backend", "gloo"]
    for n in (0, 1):
        out = (run / f"child_rank{n}.stdout").read_text()
        assert f"pipelines.capture_child: rank {n} of 2 (gloo)" in out and "1 warm-up + 3 repetitions" in out
        mine = [{k: v for k, v in d.items() if k != "rank"} for d in m["dispatch"] if d["rank"] == n]
        assert mine == m["steps"][n]["dispatch"] and sum(d["count"] for d in mine) == 8  # 2 workloads x (1 + 3)
    assert {d["rank"] for d in m["dispatch"]} == {0, 1}
    # analyze --ranks finds both ranks by their names, each with the shared manifest
    specs = ranks.discover(run)
    assert [(s.rank, s.label) for s in specs] == [(0, "trace_rank0.sqlite"), (1, "trace_rank1.sqlite")]
    assert all(s.source.manifest == m for s in specs)


def test_capture_ranks_a_failing_rank_ends_the_others(fakes, monkeypatch, capsys):
    # rank 1's nsys fails before its child starts: rank 0 waits in the rendezvous until the capture ends it, and
    # then exits 1 too: the error names rank 1, the first to fail
    monkeypatch.setenv("FAKE_NSYS_FAIL_RANK", "1")
    assert run_capture(fakes / "runs", "--ranks", "2") == EXIT_CHECK_FAILED
    run = only_run(fakes / "runs")
    m = json.loads((run / "manifest.json").read_text())
    assert run.name.endswith("-failed") and m["status"] == "failed"
    assert m["error"].startswith("nsys profile rank 1 exited 1: fake nsys: injected failure")
    assert [s["exit_code"] != 0 for s in m["steps"]] == [True, True]  # rank 0 ended, not left waiting
    assert "Traceback" not in capsys.readouterr().err


def test_require_fused_with_ranks_asks_analyze_ranks(tmp_path, monkeypatch):
    from pipelines import analyze

    seen = []
    monkeypatch.setattr(analyze, "verdict", lambda argv: seen.append(argv) or (0, ""))
    (tmp_path / "run").mkdir()
    manifest = {"steps": []}
    assert capture.require_fused(tmp_path / "run", manifest, ranks=True) == (EXIT_OK, "")
    assert seen == [["--ranks", str(tmp_path / "run"), "--out", str(tmp_path / "run" / "report"),
                     "--require-fused"]]
    assert manifest["steps"][-1]["command"][3:] == seen[0]


@pytest.mark.parametrize("sig, code, why", [(signal.SIGTERM, 143, "terminated (SIGTERM)"),
                                            (signal.SIGINT, 130, "interrupted (SIGINT)")])
def test_a_signal_to_capture_ranks_ends_every_rank_and_keeps_a_failed_run(fakes, monkeypatch, sig, code, why):
    """Issue 29 item 13: SIGTERM (timeout, CI runners, Slurm) killed capture alone; the ranks lived on (the waiting
    one for gloo's 30 minutes) and the run stayed hidden as .tmp-<pid>. Now as SIGINT: every rank's tree ended, a
    -failed run that says why, the shell's exit code for the signal."""
    from pipelines import procs

    monkeypatch.setenv("FAKE_NSYS_HANG_RANK", "1")  # rank 1 never joins: rank 0 waits in the rendezvous
    out = fakes / "runs"
    cap = subprocess.Popen([sys.executable, "-m", "pipelines.capture", "--workload", "logp-native", *SMALL,
                            "--output-dir", str(out), "--ranks", "2"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        tree = set()
        for _ in range(600):  # until rank 1's stand-in and rank 0's child program both run
            tree = procs.descendants(cap.pid)
            cmdlines = [pathlib.Path(f"/proc/{p}/cmdline").read_bytes() for p in tree
                        if pathlib.Path(f"/proc/{p}/cmdline").exists()]
            if list(out.glob(".*/trace_rank1.pid")) and any(b"pipelines.capture_child" in c for c in cmdlines):
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the ranks did not start")
        cap.send_signal(sig)  # to capture alone, as `kill`, timeout and Slurm send it
        _, err = cap.communicate(timeout=120)
    finally:
        if cap.poll() is None:
            procs.end([cap], own_session=False)
    assert cap.returncode == code, err
    run = only_run(out)
    assert run.name.endswith("-failed")  # renamed: no .tmp-<pid> left
    m = json.loads((run / "manifest.json").read_text())
    assert (m["status"], m["error"]) == ("failed", why)
    assert err.strip().splitlines()[-1] == f"pipelines.capture: {why} [run kept as {run}]" and "Traceback" not in err
    assert len(tree) >= 4 and not [p for p in tree if procs.alive(p)]  # both nsys, rank 0's child, the stand-in
