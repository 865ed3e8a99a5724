"""A bad value of one of the project's run-time variables is a usage error at every entry point (issue 29 item 20):
exit 2, one line naming the variable, no traceback, nothing written (as the compile gate already does).

Before: RLKERNEL_REQUIRE_FUSED=bogus made the profile suite write a report of failed rows and exit 1, capture keep
a -failed run, grpo_single_gpu.py end in an EnvFlagError traceback."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlkernel.cli import EXIT_USAGE
from tests import fake_nsys
from tests.subprocess_env import pythonpath

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.smoke

BAD = [("RLKERNEL_REQUIRE_FUSED", "bogus", "is not a boolean"), ("RLKERNEL_VALIDATE", "maybe", "use 1"),
       ("RLKERNEL_CAPTURE_STEPS", "3:1", "the first step 3 is after the last 1")]


def entry_points(out: Path) -> dict[str, list[str]]:
    py = sys.executable
    return {
        "profile suite": [py, str(ROOT / "scripts/run_profile_suite.py"), "--smoke", "--device", "cpu",
                          "--workloads", "logp-native", "--output-dir", str(out)],
        "capture": [py, "-m", "pipelines.capture", "--workload", "logp-native", "--device", "cpu", "--batch-size", "2",
                    "--seq-len", "4", "--vocab-size", "64", "--repeat", "1", "--warmup", "0", "--output-dir", str(out)],
        "capture -- CMD": [py, "-m", "pipelines.capture", "--output-dir", str(out), "--", py, "-c", "print(1)"],
        "grpo_single_gpu": [py, str(ROOT / "examples/grpo_single_gpu.py"), "--device", "cpu", "--steps", "1",
                            "--num-prompts", "1", "--samples-per-prompt", "2", "--prompt-len", "2",
                            "--completion-len", "2", "--vocab-size", "16", "--hidden-dim", "8"],
    }


@pytest.mark.parametrize("var, value, words", BAD, ids=[b[0] for b in BAD])
@pytest.mark.parametrize("entry", ["profile suite", "capture", "capture -- CMD", "grpo_single_gpu"])
def test_bad_flag_value_is_exit_2_one_line_nothing_written(tmp_path, entry, var, value, words):
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{fake_nsys.install(tmp_path / 'bin')}{os.pathsep}{os.environ['PATH']}",
               PYTHONPATH=pythonpath())
    env[var] = value
    proc = subprocess.run(entry_points(out)[entry], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert len(lines) == 1 and (f"{var}='{value}'" in lines[0] or f"{var} '{value}'" in lines[0]), lines
    assert words in lines[0] and "Traceback" not in proc.stderr
    assert not out.exists() and proc.stdout == ""
