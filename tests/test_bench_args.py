"""The benchmarks refuse arguments they cannot run with one line and exit 2, before they look for a GPU (so this
runs on CPU), and never with a traceback: bench_sampling (top-k 0 in the table mode, whose torch.topk column needs
k >= 1; ``--logprobs`` times the fused calls alone, top-k 0 included), bench_linear_logp_loss, bench_nvtx_overhead
(and a bad RLKERNEL_* variable, as at every CLI), bench_overhead, bench_analyze and bench_ranks."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.subprocess_env import pythonpath

ROOT = Path(__file__).resolve().parent.parent


def bench(script, *args, **env):
    full = dict(os.environ, PYTHONPATH=pythonpath(), CUDA_VISIBLE_DEVICES="", **env)
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True,
                          text=True, env=full, timeout=120)


@pytest.mark.parametrize("script,args,message", [
    ("bench_sampling.py", ["--top-k", "-1"], "--top-k must be >= 0"),
    ("bench_sampling.py", ["--top-p", "0"], "--top-p must be in (0, 1]"),
    ("bench_sampling.py", ["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    ("bench_sampling.py", ["--temperature", "0"], "--temperature must be > 0"),
    ("bench_sampling.py", ["--top-k", "0"], "--top-k 0 (no top-k) is timed with --logprobs only"),
    ("bench_sampling.py", ["--batches", "abc"], "--batches must be comma-separated integers >= 1"),
    ("bench_sampling.py", ["--batches", "1,0"], "--batches must be comma-separated integers >= 1"),
    ("bench_sampling.py", ["--vocab", "0"], "--vocab must be >= 1"),
    ("bench_sampling.py", ["--dtypes", "bogus"], "--dtypes: each of float32, bfloat16, float16"),
    ("bench_linear_logp_loss.py", ["--chunk-size", "0"], "--chunk-size must be >= 1"),
    ("bench_linear_logp_loss.py", ["--temperature", "nan"], "--temperature must be a finite number > 0"),
    ("bench_nvtx_overhead.py", ["--iters", "0"], "--iters must be >= 1000"),
    ("bench_nvtx_overhead.py", ["--device", "tpu"], "invalid choice"),
    ("bench_overhead.py", ["--cpu-only", "--calls", "0"], "--calls and --runs must be >= 1"),
    ("bench_overhead.py", ["--cpu-only", "--cases", "sample-b1"], "give them without --cases"),
    ("bench_overhead.py", ["--cases", "bogus"], "unknown case(s) bogus"),
    ("bench_analyze.py", ["--fixture", "/nonexistent.sqlite"], "--fixture /nonexistent.sqlite: not an SQLite export"),
    ("bench_analyze.py", ["--workdir", __file__], "not a directory"),
    ("bench_analyze.py", ["--export", __file__, "--limit", "nan"], "--limit must be a number of seconds > 0"),
])
def test_bad_arguments_exit_2_with_one_line(script, args, message):
    proc = bench(script, *args)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in proc.stderr, lines
    assert proc.stdout == ""


def test_bench_ranks_refuses_a_missing_source():
    proc = bench("bench_ranks.py", "--source", "/nonexistent.sqlite")
    assert proc.returncode == 2 and "--source /nonexistent.sqlite: no such file" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_bad_env_flag_is_exit_2():
    proc = bench("bench_nvtx_overhead.py", "--device", "cpu", RLKERNEL_REQUIRE_FUSED="bogus")
    assert proc.returncode == 2 and "RLKERNEL_REQUIRE_FUSED" in proc.stderr and "Traceback" not in proc.stderr


def test_top_k_0_with_logprobs_passes_the_checks():
    """Past the argument checks it needs a GPU: on a CPU-only run that is the next refusal, exit 3."""
    proc = bench("bench_sampling.py", "--logprobs", "--top-k", "0")
    assert proc.returncode == 3 and "needs a CUDA GPU" in proc.stderr, (proc.returncode, proc.stderr)
