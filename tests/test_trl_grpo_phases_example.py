"""examples/trl_grpo_phases.py: a tiny TRL GRPOTrainer run emits the standard phases (contract 3) where TRL runs
them, seen through `pipelines.capture -- CMD` with the stand-in nsys and the real NVTX tool (tests/nvtx_log.c)."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests import fake_nsys, nvtx_log
from tests.subprocess_env import pythonpath

ROOT = pathlib.Path(__file__).resolve().parent.parent
pytest.importorskip("trl")
pytest.importorskip("datasets")


def test_trl_grpo_run_emits_the_standard_phases_inside_its_steps(tmp_path):
    env = dict(os.environ, PATH=f"{fake_nsys.install(tmp_path / 'bin')}{os.pathsep}{os.environ['PATH']}",
               FAKE_NSYS_NVTX_LIB=str(nvtx_log.library(tmp_path)),
               PYTHONPATH=pythonpath())
    for var in ("NSYS", "RLKERNEL_CAPTURE_STEPS", "FAKE_NSYS_FAIL", "FAKE_NSYS_NO_REP", "FAKE_NSYS_EXPORT_FAIL"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-m", "pipelines.capture", "--output-dir", str(tmp_path / "runs"), "--",
                           sys.executable, str(ROOT / "examples/trl_grpo_phases.py"), "--max-steps", "2",
                           "--device", "cpu"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trl_grpo_phases: 2 GRPO step(s) on cpu" in proc.stdout
    (run,) = (tmp_path / "runs").iterdir()
    assert run.name.endswith("Z-trl_grpo_phases")
    target = json.loads((run / "manifest.json").read_text())["target"]
    # step 0 generates (rollout, old and reference log-probs); step 1 trains again on the same rollout
    # (num_iterations 2); every step runs loss (holding the training forward), backward and the optimizer
    assert {p["name"]: p["instances"] for p in target["phases"]} == {
        "step": 2, "rollout": 1, "old_logprob": 1, "reference_logprob": 1, "loss": 2, "policy_forward": 2,
        "backward": 2, "optimizer": 2}
    assert target["step_indices"] == [[0, 1]]
    ranges = nvtx_log.ranges(run / "trace.nvtx.log")  # what the stand-in exported from
    steps = [r for r in ranges if r.message == "phase:step"]
    assert [s.payload for s in steps] == [0, 1] and all(s.depth == 0 for s in steps)

    def inside(r, outer):
        return outer.start < r.start and r.end < outer.end and outer.tid == r.tid

    for r in ranges:
        if r.message != "phase:step":
            assert any(inside(r, s) for s in steps), r
    loss = [r for r in ranges if r.message == "phase:loss"]
    for r in ranges:
        if r.message == "phase:policy_forward":
            assert any(inside(r, outer) for outer in loss), r  # contract 3: loss holds policy_forward
    first = [r.message for r in ranges if inside(r, steps[0]) and r.depth == 1]
    assert first == ["phase:rollout", "phase:old_logprob", "phase:reference_logprob", "phase:loss", "phase:backward",
                     "phase:optimizer"]
