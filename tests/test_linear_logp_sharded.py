"""Sharded LM heads through rlkernel.linear_logp: a training step of a tiny model with the head under FSDP2 (a DTensor,
gathered once per call) and under DeepSpeed ZeRO-3 (partitioned: gathered in the forward and again in the backward:
linear_logp's recomputes, linear_logp_loss's only hands autograd the whole gradient to accumulate), each on one CPU
rank (gloo) in its own process (tests/sharded_train.py), gradients against the unsharded run's. ZeRO-3 needs
deepspeed (`tox -e zero3` installs it, DS_BUILD_OPS=0, and makes a missing one fail); elsewhere it is skipped."""
from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from integration_support import required

import rlkernel
from tests.subprocess_env import pythonpath

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def train(kind: str, op: str) -> dict:
    env = dict(os.environ, PYTHONPATH=pythonpath())
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "sharded_train.py"), kind, free_port(), op],
                          capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check(result: dict):
    assert result["loss"] == result["ref_loss"]
    for name, diff in result["diffs"].items():  # the same float32 arithmetic on the same values: equal
        assert diff <= 1e-6 * result["scale"], (name, diff)


OPS = ["linear_logp", "linear_logp_loss"]


@pytest.mark.parametrize("op", OPS)
def test_fsdp2_dtensor_head_trains_as_unsharded(op):
    result = train("fsdp2", op)
    assert result["head_is_dtensor"]
    check(result)


@pytest.mark.parametrize("op", OPS)
def test_zero3_partitioned_head_trains_as_unsharded(op):
    if importlib.util.find_spec("deepspeed") is None and not required("deepspeed"):
        pytest.skip("deepspeed not installed (tox -e zero3)")
    result = train("zero3", op)
    assert result["head_partitioned"] and result["head_released_after_step"]
    check(result)


def test_sharded_helpers_leave_plain_tensors_alone():
    import torch

    from rlkernel.ops import sharded

    t = torch.ones(2, 2)
    assert sharded.full(t) is t and sharded.full(None) is None
    assert sharded.zero3_partitioned(t, None) == ()
    assert rlkernel.linear_logp(t, t, torch.zeros(2, dtype=torch.long)).shape == (2,)
