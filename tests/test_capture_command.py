"""python -m pipelines.capture [options] -- CMD (issue 34) end to end on the CPU.

nsys cannot run here: tests/fake_nsys.py stands in for it (the one edge), running the real command under a real
NVTX tool (tests/nvtx_log.c) and exporting the ranges it recorded in nsys's schema, so the phases the manifest
lists are the ones the command's rlkernel.phase / rlkernel.step opened. Everything else is real: the capture
process, the command, its children, the signals, the node record, the analyzer.
"""
import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pipelines import capture_command, procs
from rlkernel.cli import EXIT_CHECK_FAILED, EXIT_OK, EXIT_USAGE
from tests import fake_nsys, nvtx_log
from tests.subprocess_env import pythonpath

ROOT = pathlib.Path(__file__).resolve().parent.parent

PHASES = """
import sys
import rlkernel

for i in range(3):
    with rlkernel.step():
        with rlkernel.phase("rollout"):
            print(f"step {i}", flush=True)
        with rlkernel.phase("loss"):
            pass
print("stderr line", file=sys.stderr)
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
"""


@pytest.fixture
def env(tmp_path):
    """The environment a capture runs in: the fake nsys first on PATH, the NVTX tool for it, this tree's rlkernel
    importable by the command (capture itself leaves the command's PYTHONPATH alone)."""
    e = dict(os.environ, PATH=f"{fake_nsys.install(tmp_path / 'bin')}{os.pathsep}{os.environ['PATH']}",
             FAKE_NSYS_NVTX_LIB=str(nvtx_log.library(tmp_path)),
             PYTHONPATH=pythonpath())
    for var in ("NSYS", "FAKE_NSYS_FAIL", "FAKE_NSYS_NO_REP", "FAKE_NSYS_EXPORT_FAIL", "RLKERNEL_CAPTURE_STEPS",
                "RLKERNEL_REQUIRE_FUSED", "RLKERNEL_VALIDATE"):
        e.pop(var, None)
    return e


def program(tmp_path, text=PHASES, name="train_job.py") -> pathlib.Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def capture(tmp_path, env, *args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipelines.capture", "--output-dir", str(tmp_path / "runs"), *args],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=timeout)


def only_run(tmp_path) -> pathlib.Path:
    entries = list((tmp_path / "runs").iterdir())
    assert len(entries) == 1, entries  # one run, no temporary folder left behind
    return entries[0]


def manifest(run) -> dict:
    return json.loads((run / "manifest.json").read_text())


# ---- a whole run -----------------------------------------------------------------------------------------

def test_a_command_under_nsys(tmp_path, env):
    prog = program(tmp_path)
    env["SECRET_TOKEN"] = "must-not-leak"
    proc = capture(tmp_path, env, "--", sys.executable, str(prog), "0")
    assert proc.returncode == EXIT_OK, proc.stderr
    run = only_run(tmp_path)
    # the command's output comes through; the run's path is the last line on stdout
    out = proc.stdout.strip().splitlines()
    assert out[:3] == ["step 0", "step 1", "step 2"] and out[-1] == str(run)
    assert "stderr line" in proc.stderr and "phases seen: step x3, rollout x3, loss x3; steps 0-2" in proc.stderr
    assert run.name.endswith("Z-train_job") and not run.name.endswith("-failed")
    assert {"manifest.json", "trace.nsys-rep", "trace.sqlite", "tools.stdout", "tools.stderr"} <= \
        {p.name for p in run.iterdir()}
    assert capture_command.RECORD not in {p.name for p in run.iterdir()}
    m = manifest(run)
    assert (m["status"], m["error"], m["workloads"], m["dispatch"]) == ("complete", None, [], [])
    t = m["target"]
    assert t["argv"] == ["<path>/" + pathlib.Path(sys.executable).name, "<path>/train_job.py", "0"]
    assert (t["name"], t["exit_code"], t["signal"], t["steps"]) == ("train_job", 0, None, None)
    assert t["phases"] == [{"name": "step", "instances": 3, "processes": 1},
                           {"name": "rollout", "instances": 3, "processes": 1},
                           {"name": "loss", "instances": 3, "processes": 1}]
    assert t["step_indices"] == [[0, 2]]
    assert [s["name"] for s in m["steps"]] == ["nsys profile", "nsys export"]
    # contract 9: every recorded command line is scrubbed, argument by argument
    text = json.dumps([m["command"], m["steps"], t])
    assert str(tmp_path) not in text and m["command"][-3:] == t["argv"]
    prof = m["steps"][0]["command"]
    assert prof[:8] == ["<path>/nsys", "profile", "--trace=cuda,nvtx,osrt", "--sample=none", "--cpuctxsw=none",
                        "--cuda-graph-trace=node", "--trace-fork-before-exec=true", "-o"]
    assert prof[-7:-3] == ["-I", "<path>/capture_exec.py", "<path>/" + capture_command.RECORD, "--"]
    assert m["node"]["python"] and m["node"]["devices"]  # rlkernel.env's record, taken in a subprocess
    assert m["tools"]["nsys"]["version"] == "2099.1.1.1-fake" and "must-not-leak" not in json.dumps(m)


def test_the_analyzer_reads_a_command_run(tmp_path, env):
    pytest.importorskip("duckdb")
    from pipelines import analyze

    assert capture(tmp_path, env, "--name", "job", "--", sys.executable, str(program(tmp_path))).returncode == 0
    run = only_run(tmp_path)
    assert run.name.endswith("Z-job")
    assert analyze.main([str(run)]) == EXIT_OK
    import csv

    with open(run / "report" / "range_summary.csv") as f:
        got = {r["range"]: int(r["instances"]) for r in csv.DictReader(f)}
    assert got == {"rlkernel:phase:step": 3, "rlkernel:phase:rollout": 3, "rlkernel:phase:loss": 3}


def test_require_fused_on_a_command_run_asks_the_analyzer(tmp_path, env):
    pytest.importorskip("duckdb")
    proc = capture(tmp_path, env, "--require-fused", "--", sys.executable, str(program(tmp_path)))
    assert proc.returncode == EXIT_OK, proc.stderr
    step = manifest(only_run(tmp_path))["steps"][-1]
    assert (step["name"], step["exit_code"]) == ("analyze --require-fused", 0)


@pytest.mark.smoke
def test_capture_imports_no_torch_for_a_command(tmp_path, env):
    code = ("import sys; from pipelines import capture; rc = capture.main(sys.argv[1:]); "
            "print('torch imported' if 'torch' in sys.modules else 'no torch', file=sys.stderr); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, "--output-dir", str(tmp_path / "runs"), "--",
                           sys.executable, "-c", "print('hi')"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "no torch" and proc.stdout.startswith("hi\n")
    assert manifest(only_run(tmp_path))["node"]["torch"]  # the node record still names torch: its subprocess


# ---- failures: the command's exit code comes through, a -failed run says why -------------------------------

@pytest.mark.parametrize("code", [1, 3, 42])
def test_the_commands_exit_code_is_captures(tmp_path, env, code):
    proc = capture(tmp_path, env, "--", sys.executable, str(program(tmp_path)), str(code))
    assert proc.returncode == code
    run = only_run(tmp_path)
    assert run.name.endswith("-failed") and proc.stdout.strip().splitlines()[-1] == str(run)
    m = manifest(run)
    assert (m["status"], m["error"], m["target"]["exit_code"]) == ("failed", f"the command exited {code}", code)
    assert (run / "trace.sqlite").exists() and m["target"]["phases"]  # the failed job's trace is kept
    assert proc.stderr.strip().splitlines()[-1] == f"pipelines.capture: the command exited {code} [run kept as {run}]"


def test_a_command_killed_by_a_signal(tmp_path, env):
    proc = capture(tmp_path, env, "--", sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert proc.returncode == 128 + signal.SIGKILL
    m = manifest(only_run(tmp_path))
    assert m["error"] == "the command was killed by SIGKILL (exit 137)" and m["target"]["signal"] == "SIGKILL"


def test_a_command_that_does_not_exist(tmp_path, env):
    proc = capture(tmp_path, env, "--", "no-such-program-rlkernel")
    assert proc.returncode == 127
    run = only_run(tmp_path)
    assert manifest(run)["error"] == ("the command could not start: cannot run 'no-such-program-rlkernel': "
                                      "No such file or directory")
    assert "Traceback" not in proc.stderr


def test_nsys_failing_before_the_command(tmp_path, env):
    env["FAKE_NSYS_FAIL"] = "1"
    proc = capture(tmp_path, env, "--", sys.executable, "-c", "pass")
    assert proc.returncode == EXIT_CHECK_FAILED
    m = manifest(only_run(tmp_path))
    assert m["error"] == "nsys profile exited 1 before the command ran (its output is above)"
    assert m["target"]["exit_code"] is None


def test_a_failed_export_fails_the_run(tmp_path, env):
    env["FAKE_NSYS_EXPORT_FAIL"] = "1"
    proc = capture(tmp_path, env, "--", sys.executable, "-c", "pass")
    assert proc.returncode == EXIT_CHECK_FAILED
    m = manifest(only_run(tmp_path))
    assert m["error"] == "nsys export exited 1: fake nsys: injected export failure (see tools.stderr)"


SLEEPER = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(f"{os.getpid()} {child.pid}")
time.sleep(600)
"""


@pytest.mark.parametrize("sig, code, why", [(signal.SIGTERM, 143, "terminated (SIGTERM)"),
                                            (signal.SIGINT, 130, "interrupted (SIGINT)")])
def test_a_signal_ends_the_command_tree_and_keeps_a_failed_run(tmp_path, env, sig, code, why):
    pids = tmp_path / "pids"
    cap = subprocess.Popen([sys.executable, "-m", "pipelines.capture", "--output-dir", str(tmp_path / "runs"), "--",
                            sys.executable, str(program(tmp_path, SLEEPER, "sleeper.py")), str(pids)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        for _ in range(600):
            if pids.exists() and len(pids.read_text().split()) == 2:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the command did not start")
        tree = procs.descendants(cap.pid)
        cap.send_signal(sig)  # to capture alone: Ctrl-C's SIGINT does not reach the command's own session
        out, err = cap.communicate(timeout=120)
    finally:
        if cap.poll() is None:
            procs.end([cap], own_session=False)
    assert cap.returncode == code, err
    run = only_run(tmp_path)
    assert run.name.endswith("-failed") and out.strip().splitlines()[-1] == str(run)
    assert manifest(run)["error"] == why
    assert err.strip().splitlines()[-1] == f"pipelines.capture: {why} [run kept as {run}]"
    command, grandchild = map(int, pids.read_text().split())
    assert {command, grandchild} <= tree
    for _ in range(100):
        if not any(procs.alive(p) for p in tree):
            break
        time.sleep(0.05)
    assert not [p for p in tree if procs.alive(p)]  # nsys, the exec shim, the command and its child: all ended


# ---- --steps ----------------------------------------------------------------------------------------------

def test_steps_sets_the_capture_range_and_the_window(tmp_path, env):
    proc = capture(tmp_path, env, "--steps", "1:2", "--", sys.executable, str(program(tmp_path)))
    assert proc.returncode == EXIT_OK, proc.stderr
    run = only_run(tmp_path)
    fake = json.loads((run / "trace.fake.json").read_text())  # what nsys was given
    assert fake["argv"][fake["argv"].index("--trace-fork-before-exec=true") + 1:][:2] == [
        "--capture-range=cudaProfilerApi", "--capture-range-end=stop"]
    assert fake["env"]["RLKERNEL_CAPTURE_STEPS"] == "1:2"
    m = manifest(run)
    assert m["target"]["steps"] == [1, 2] and m["env"]["RLKERNEL_CAPTURE_STEPS"] == "1:2"


def test_without_steps_a_stray_window_is_not_passed_on(tmp_path, env):
    env["RLKERNEL_CAPTURE_STEPS"] = "0:1"  # would stop the profiler half-way through a whole-run capture
    assert capture(tmp_path, env, "--", sys.executable, "-c", "pass").returncode == EXIT_OK
    run = only_run(tmp_path)
    fake = json.loads((run / "trace.fake.json").read_text())
    assert fake["env"]["RLKERNEL_CAPTURE_STEPS"] is None and "--capture-range=cudaProfilerApi" not in fake["argv"]
    assert "RLKERNEL_CAPTURE_STEPS" not in manifest(run)["env"]


def test_steps_window_never_reached(tmp_path, env):
    env["FAKE_NSYS_NO_REP"] = "1"  # what nsys leaves when the capture range never started
    proc = capture(tmp_path, env, "--steps", "5:6", "--", sys.executable, "-c", "pass")
    assert proc.returncode == EXIT_CHECK_FAILED
    error = manifest(only_run(tmp_path))["error"]
    assert error.startswith("nsys wrote no trace.nsys-rep: with --steps 5:6 nothing is recorded until a step")


# ---- several processes: torchrun ---------------------------------------------------------------------------

def test_a_two_process_torchrun_is_one_export(tmp_path, env):
    """nsys follows the launcher's children into one export (contract 10 splits it by process): the phases of both
    gloo ranks of tools/traces/phases_job.py (the torchrun fixture's program) are in the one trace, each phase seen
    in 2 processes."""
    torchrun = pathlib.Path(sys.executable).with_name("torchrun")
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    env["GLOO_SOCKET_IFNAME"] = "lo"
    proc = capture(tmp_path, env, "--", *launcher, "--standalone", "--nproc-per-node", "2",
                   str(ROOT / "tools/traces/phases_job.py"), "--steps", "2", timeout=600)
    assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
    assert "rank 0 of 2: 2 steps" in proc.stdout and "rank 1 of 2: 2 steps" in proc.stdout
    run = only_run(tmp_path)
    t = manifest(run)["target"]
    assert t["phases"] == [{"name": n, "instances": 4, "processes": 2} for n in (
        "step", "rollout", "old_logprob", "reference_logprob", "loss", "policy_forward", "backward", "weight_sync",
        "optimizer")]
    assert t["step_indices"] == [[0, 1]] and run.name.endswith(("Z-torchrun-phases_job", "Z-torch.distributed.run"))


# ---- arguments ----------------------------------------------------------------------------------------------

@pytest.mark.smoke
@pytest.mark.parametrize("argv, words", [
    (["--"], "-- must be followed by the command"),
    (["--steps", "3:1", "--", "x"], "--steps '3:1': the first step 3 is after the last 1"),
    (["--steps", "a", "--", "x"], "--steps 'a': use A:B"),
    (["--name", "a b", "--", "x"], "--name 'a b': use 1 to 64 letters"),
    (["--trace", "cuda", "--", "x"], "--trace must include cuda and nvtx"),
    (["--trace", "cuda,nvtx,gpu", "--", "x"], "--trace: unknown 'gpu'"),
    (["--batch-size", "2", "--", "x"], "unrecognized arguments: --batch-size (a --workload option"),
    (["--workload", "logp-native", "--", "x"], "unrecognized arguments: --workload (a --workload option"),
    (["--ranks", "2", "--", "x"], "unrecognized arguments: --ranks"),
    (["--steps", "1:2", "--workload", "logp-native"], "--steps goes with -- CMD"),
    (["--name", "x", "--workload", "logp-native"], "--name goes with -- CMD"),
    ([], "give --workload NAME"),
])
def test_bad_arguments_exit_2_one_line_nothing_made(tmp_path, env, argv, words):
    proc = capture(tmp_path, env, *argv)
    assert proc.returncode == EXIT_USAGE, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in proc.stderr, lines
    assert not (tmp_path / "runs").exists() and proc.stdout == ""


@pytest.mark.smoke
@pytest.mark.parametrize("cmd, name", [
    (["python", "train.py", "--lr", "1"], "train"),
    (["/usr/bin/python3.11", "-u", "/home/u/x/grpo run.py"], "grpo_run"),
    (["python3", "-m", "verl.trainer.main_ppo", "a=b"], "verl.trainer.main_ppo"),
    (["python", "-c", "print(1)"], "python-c"),
    (["torchrun", "--nproc-per-node", "2", "train_grpo.py"], "torchrun-train_grpo"),
    (["accelerate", "launch", "--num_processes", "2", "/x/y/sft.py"], "accelerate-sft"),
    (["torchrun", "--standalone", "-m", "pkg.train"], "torchrun-pkg.train"),
    (["./run.sh", "x"], "run"),
    (["/opt/bin/my job"], "my_job"),
    (["..."], "command"),
])
def test_run_names_for_commands(cmd, name):
    assert capture_command.run_name(cmd) == name


@pytest.mark.smoke
def test_help_names_the_command_form():
    proc = subprocess.run([sys.executable, "-m", "pipelines.capture", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "-- CMD [ARGS...]" in proc.stdout and "--steps A:B" in proc.stdout


@pytest.mark.smoke
def test_scrub_argv_argument_by_argument():
    from rlkernel.textsafe import scrub_argv

    # issue 29 item 22's two leaks, for the command lines this manifest records: a path with a space, a glued value
    assert scrub_argv(["/home/user name/venv/bin/python", "-o/home/u/out", "--out=/a/b/c", "train.py", "x=/etc/y z",
                       "/", "--lr=1e-3", "-x"]) == ["<path>/python", "-o<path>/out", "--out=<path>/c", "train.py",
                                                   "x=<path>/y z", "/", "--lr=1e-3", "-x"]


def test_a_signal_during_the_verdict_keeps_the_complete_run(tmp_path, env, monkeypatch, capsys):
    from pipelines import analyze, capture

    for k in ("PATH", "PYTHONPATH", "FAKE_NSYS_NVTX_LIB"):
        monkeypatch.setenv(k, env[k])

    def terminated(argv):
        raise procs.Terminated(signal.SIGTERM)

    monkeypatch.setattr(analyze, "verdict", terminated)
    rc = capture.main(["--require-fused", "--output-dir", str(tmp_path / "runs"), "--", sys.executable, "-c", "pass"])
    run = only_run(tmp_path)
    assert rc == 143 and manifest(run)["status"] == "complete" and not run.name.endswith("-failed")
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"pipelines.capture: terminated (SIGTERM) during --require-fused (the run is complete: {run})"
