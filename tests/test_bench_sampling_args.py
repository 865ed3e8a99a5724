"""benchmarks/bench_sampling.py refuses settings it cannot time with one line and exit 2, before it looks for a GPU
(so this runs on CPU): a negative top-k, top-p outside (0, 1], a temperature that is not positive, and top-k 0 in
the table mode, whose torch.topk column needs k >= 1 (``--logprobs`` times the fused calls alone, top-k 0 included)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.subprocess_env import pythonpath

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("args,message", [
    (["--top-k", "-1"], "--top-k must be >= 0"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--temperature", "0"], "--temperature must be > 0"),
    (["--top-k", "0"], "--top-k 0 (no top-k) is timed with --logprobs only"),
])
def test_bad_settings_exit_2_with_one_line(args, message):
    env = dict(os.environ, PYTHONPATH=pythonpath(), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_sampling.py"), *args],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"bench_sampling: {message}"), lines
    assert proc.stdout == ""


def test_top_k_0_with_logprobs_passes_the_checks():
    """Past the argument checks it needs a GPU: on a CPU-only run that is the next refusal, exit 3."""
    env = dict(os.environ, PYTHONPATH=pythonpath(), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_sampling.py"), "--logprobs", "--top-k",
                           "0"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 3 and "needs a CUDA GPU" in proc.stderr, (proc.returncode, proc.stderr)
