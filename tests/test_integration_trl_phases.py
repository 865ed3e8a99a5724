"""rlkernel.integrations.trl's phases (contract 3) against the real TRL: a tiny GRPOTrainer run (examples/trl_grpo.py,
CPU) under apply() emits the standard phase ranges where TRL runs them, seen by a real NVTX tool (tests/nvtx_log.c)
in a subprocess, with the fused head's op ranges inside the phases that call it; undo() puts GRPOTrainer's methods
back (a run after it emits nothing); a train() that raises inside a step closes the step. Skipped without trl."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.subprocess_env import pythonpath

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from integration_support import framework  # noqa: E402

trl = framework("trl", "trl")

from trl.generation import vllm_generation  # noqa: E402

import rlkernel  # noqa: E402
from rlkernel import phases  # noqa: E402
from rlkernel.integrations import trl as rk_trl  # noqa: E402
from tests import nvtx_log  # noqa: E402

RUN = """
    import sys, time, torch
    sys.path.insert(0, {examples!r})
    import trl_grpo
    from rlkernel.integrations import trl as rk_trl
    args = trl_grpo.build_parser().parse_args(["--steps", "2"])
    folder = __import__("pathlib").Path({folder!r})
    trl_grpo.save_tiny_model(folder, args, torch.float32)
    with rk_trl.apply():  # the default: TRL's head by rlkernel and the phases
        trl_grpo.train(folder, args, torch.device("cpu"), torch.float32)
    print(time.monotonic_ns(), flush=True)  # undone: the next run is TRL's own, with no range
    trl_grpo.train(folder, args, torch.device("cpu"), torch.float32)
"""


def test_a_grpo_run_under_apply_emits_the_standard_phases_and_undo_removes_them(tmp_path):
    log = tmp_path / "nvtx.log"
    env = nvtx_log.environ(nvtx_log.library(tmp_path), log)
    env["PYTHONPATH"] = pythonpath()
    env.pop("RLKERNEL_CAPTURE_STEPS", None)
    code = textwrap.dedent(RUN.format(examples=str(ROOT / "examples"), folder=str(tmp_path / "model")))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    undone_at = int(proc.stdout.strip().splitlines()[-1])
    ranges = nvtx_log.ranges(log)
    assert ranges and all(r.end < undone_at for r in ranges)  # after undo(): neither phases nor op ranges
    steps = [r for r in ranges if r.message == "phase:step"]
    assert [(s.payload, s.depth) for s in steps] == [(0, 0), (1, 0)]

    def inside(r, outer):
        return outer.start < r.start and r.end < outer.end and outer.tid == r.tid

    phase_ranges = [r for r in ranges if r.message.startswith("phase:") and r.message != "phase:step"]
    for r in phase_ranges:
        assert any(inside(r, s) for s in steps), r
    # per step (num_iterations 1, beta > 0): one rollout, the reference model's log-probs, the training forward
    # inside the loss, one backward and one optimizer step
    per_step = [[r.message for r in phase_ranges if inside(r, s) and r.depth == 1] for s in steps]
    assert per_step == [["phase:rollout", "phase:reference_logprob", "phase:loss", "phase:backward",
                         "phase:optimizer"]] * 2
    loss = [r for r in ranges if r.message == "phase:loss"]
    forwards = [r for r in ranges if r.message == "phase:policy_forward"]
    assert len(forwards) == 2 and all(any(inside(f, o) for o in loss) for f in forwards)
    assert {r.message for r in phase_ranges} <= {f"phase:{n}" for n in phases.STANDARD}
    # the head's op ranges nest in the phase that calls it: the policy's forward and the reference model's
    heads = [r for r in ranges if r.message == "op.linear_logp.forward"]
    holders = [r for r in ranges if r.message in ("phase:policy_forward", "phase:reference_logprob")]
    assert len(heads) == 4 and all(any(inside(h, o) for o in holders) for h in heads)


def test_apply_patches_grpo_trainer_on_the_class_and_undo_puts_it_back():
    cls = trl.GRPOTrainer
    names = ("_generate", "_get_per_token_logps_and_entropies", "compute_loss")
    before = {n: vars(cls)[n] for n in names}
    assert "train" not in vars(cls)  # Trainer's own
    train = cls.train
    sync = vllm_generation.VLLMGeneration.sync_weights
    with rk_trl.apply() as p:
        assert rk_trl.apply() is p and p.options["phases"] and p.options["head"]
        for n in names:
            assert vars(cls)[n] is not before[n] and vars(cls)[n].__wrapped__ is before[n]
        assert vars(cls)["train"].__wrapped__ is train
        assert vllm_generation.VLLMGeneration.sync_weights.__wrapped__ is sync
        with pytest.raises(ValueError, match="already applied"):
            rk_trl.apply(phases=False)
    assert {n: vars(cls)[n] for n in names} == before and "train" not in vars(cls)
    assert vllm_generation.VLLMGeneration.sync_weights is sync
    with rk_trl.apply(phases=False):  # the head only: GRPOTrainer untouched
        assert {n: vars(cls)[n] for n in names} == before and "train" not in vars(cls)
    with rk_trl.apply(head=False) as q:  # the phases only: TRL's own head
        assert not isinstance(trl.trainer.utils._ChunkedLogProbFunction, rk_trl.RlkernelHead)
        assert vars(cls)["compute_loss"] is not before["compute_loss"] and q.options["head"] is False
    assert vars(cls)["compute_loss"] is before["compute_loss"]
    with pytest.raises(ValueError, match="patch nothing"):
        rk_trl.apply(head=False, phases=False)


def test_a_train_that_raises_inside_a_step_closes_it(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "examples"))
    import torch
    import trl_grpo

    monkeypatch.delenv("RLKERNEL_CAPTURE_STEPS", raising=False)
    monkeypatch.setattr(phases, "_steps", phases._Steps())

    def broken(completions, **_):
        raise KeyError("reward server down")

    args = trl_grpo.build_parser().parse_args(["--steps", "1"])
    trl_grpo.save_tiny_model(tmp_path, args, torch.float32)
    monkeypatch.setattr(trl_grpo, "reward", broken)
    with rk_trl.apply(head=False), pytest.raises(KeyError, match="reward server down"):
        trl_grpo.train(tmp_path, args, torch.device("cpu"), torch.float32)
    assert phases._steps.open is None  # the step the reward raised in was closed
    assert rlkernel.step_begin() == 1 and rlkernel.step_end() == 1  # step 0 was the one that raised
