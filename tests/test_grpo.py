"""The GRPO step (rlkernel.grpo) and its CLI (examples/grpo_single_gpu.py), on CPU."""
import dataclasses
import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from reference_filtered import kept_set

import rlkernel
from rlkernel import workloads
from rlkernel.grpo import GRPOConfig, Trainer, compare_backends, completion_mask, group_advantages, rollout

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "grpo_single_gpu.py"
GUIDE_ARGS = ["--steps", "2", "--num-prompts", "1", "--samples-per-prompt", "2", "--prompt-len", "2",
              "--completion-len", "3", "--vocab-size", "16", "--hidden-dim", "8"]
TINY = GRPOConfig(num_prompts=2, samples_per_prompt=4, prompt_len=3, completion_len=5, vocab_size=24, hidden_dim=8)


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.smoke
def test_two_steps_finite_loss_and_learning_signal():
    trainer = Trainer(TINY, "cpu")
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    results = [trainer.step() for _ in range(2)]
    for r in results:
        assert all(map(torch.isfinite, map(torch.tensor, (r.loss, r.policy_loss, r.kl)))), r
        assert r.logp_forward == ("fallback", "tensor on cpu") and r.logp_backward == ("fallback", "tensor on cpu")
        assert r.sampler_gap == 0.0  # same native path and bitwise the same logits (Policy.logits_per_position)
    assert results[0].kl == 0.0  # policy == reference before the first update
    assert results[1].kl > 0.0  # the update moved the policy (the backward reached the parameters)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters(), strict=True))


FILTERED = [(0.7, 5, 0.8), (1.0, 0, 0.6), (1.3, 7, 1.0), (0.0, 5, 0.8)]  # (temperature, top_k, top_p)


@pytest.mark.smoke
@pytest.mark.parametrize("mode", ["raw", "processed"])
@pytest.mark.parametrize("temperature,top_k,top_p", FILTERED)
def test_rollout_records_raw_and_processed_logprobs(mode, temperature, top_k, top_p):
    cfg = dataclasses.replace(TINY, temperature=temperature, top_k=top_k, top_p=top_p, rollout_logprobs=mode,
                              seed=int(torch.randint(0, 2**31, ())))
    trainer = Trainer(cfg, "cpu")
    ro = rollout(trainer.policy, cfg, trainer.generator, torch.device("cpu"))
    # the training step's logits of the completion positions: bitwise the rollout's (Policy.logits_per_position)
    with torch.no_grad():
        logits = trainer._logits(trainer.policy, ro)
    ids = ro.completions.reshape(-1)
    lp_processed = rlkernel.logp(logits, ids, temperature=temperature, top_k=top_k, top_p=top_p)
    lp_raw = rlkernel.logp(logits, ids, temperature=temperature if temperature > 0 else 1.0)  # T' (contracts)
    assert torch.equal(ro.sampler_logp_processed.reshape(-1), lp_processed)
    assert torch.equal(ro.sampler_logp_raw.reshape(-1), lp_raw)
    assert ro.sampler_logp is (ro.sampler_logp_processed if mode == "processed" else ro.sampler_logp_raw)
    # processed - raw = -log S, S = the kept mass of softmax(logits / T) (float64 reference); T = 0: processed is 0
    diffs = []
    for r in range(logits.shape[0]):
        if temperature == 0:
            assert lp_processed[r] == 0.0
            continue
        kept, _, margin = kept_set(logits[r], temperature, top_k, top_p, 0.0)
        if margin < 1e-4:  # a top-p decision too close to call in float32: the float64 set may differ
            continue
        p = torch.softmax(logits[r].double() / temperature, -1)
        neg_log_s = -math.log(float(p[kept].sum()))
        diff = float(lp_processed[r]) - float(lp_raw[r])
        assert diff == pytest.approx(neg_log_s, abs=1e-5, rel=1e-5), (r, kept)
        assert diff >= 0.0  # S <= 1: a processed log-prob is never below the raw one
        diffs.append(diff)
    if temperature > 0:
        assert max(diffs) > 1e-3  # these filters drop mass: the two kinds differ


@pytest.mark.smoke
@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_both_rollout_logprob_modes_train(mode):
    cfg = dataclasses.replace(TINY, top_k=5, top_p=0.8, rollout_logprobs=mode)
    trainer = Trainer(cfg, "cpu")
    results = [trainer.step() for _ in range(2)]
    for r in results:
        assert all(map(torch.isfinite, map(torch.tensor, (r.loss, r.policy_loss, r.kl)))), r
        assert r.rollout_logprobs == mode
        assert r.sampler_gap == 0.0  # the matching pair, same native path, bitwise the same logits
    assert results[0].kl == 0.0 and results[1].kl > 0.0


@pytest.mark.smoke
def test_rollout_logprob_modes_differ_only_under_filters():
    def params_after_one_step(**kw):
        trainer = Trainer(dataclasses.replace(TINY, **kw), "cpu")
        trainer.step()
        return [p.detach().clone() for p in trainer.policy.parameters()]

    # with filters the processed ratio's gradient lacks the log S term's: the updates differ
    raw = params_after_one_step(top_k=5, top_p=0.8, rollout_logprobs="raw")
    processed = params_after_one_step(top_k=5, top_p=0.8, rollout_logprobs="processed")
    assert any(not torch.equal(a, b) for a, b in zip(raw, processed, strict=True))
    # without a filter both kinds are the same log-prob: bitwise the same update
    raw = params_after_one_step(temperature=0.7, rollout_logprobs="raw")
    processed = params_after_one_step(temperature=0.7, rollout_logprobs="processed")
    assert all(torch.equal(a, b) for a, b in zip(raw, processed, strict=True))


@pytest.mark.smoke
def test_bad_rollout_logprobs_is_a_value_error():
    with pytest.raises(ValueError, match="rollout-logprobs must be one of raw, processed, got 'both'"):
        GRPOConfig(rollout_logprobs="both").validate()
    with pytest.raises(ValueError, match="rollout-logprobs"):
        Trainer(GRPOConfig(rollout_logprobs="Raw"), "cpu")


@pytest.mark.smoke
def test_constant_reward_group_has_zero_advantage():
    rewards = torch.tensor([0.3, 0.3, 0.3, 0.0, 1.0, 0.5, 0.7, 0.7, 0.7])
    adv = group_advantages(rewards, 3)
    assert torch.equal(adv[:3], torch.zeros(3)) and torch.equal(adv[6:], torch.zeros(3))  # exact, not ~0, not NaN
    assert torch.allclose(adv[3:6].mean(), torch.tensor(0.0), atol=1e-6)  # float32 rounding of a mean
    assert torch.allclose(adv[3:6].std(unbiased=False), torch.tensor(1.0), atol=1e-6)
    assert torch.equal(group_advantages(torch.tensor([0.4, 0.9]), 1), torch.zeros(2))  # a group of one


@pytest.mark.smoke
def test_completion_mask_ends_after_first_eos():
    c = torch.tensor([[5, 0, 3, 0], [0, 2, 2, 2], [1, 2, 3, 4]])
    assert completion_mask(c).tolist() == [[True, True, False, False], [True, False, False, False], [True] * 4]


@pytest.mark.smoke
def test_compare_backends_on_cpu_gives_identical_losses():
    steps = list(compare_backends(TINY, "cpu", 3))
    assert [c.diff for c in steps] == [0.0, 0.0, 0.0]  # both runs are native on CPU: same arithmetic
    assert all(c.first.loss == c.native.loss for c in steps)
    assert 0 < steps[0].bound < steps[-1].bound  # the bound accumulates over steps


@pytest.mark.smoke
def test_strict_flag_on_cpu_exits_3_with_one_line():
    for device_args, expected in ((["--device", "cpu"], "tensor on cpu"), (["--device", "cuda"], "CUDA")):
        if device_args[1] == "cuda" and torch.cuda.is_available():
            continue
        p = _run(*device_args, "--require-fused-logp", *GUIDE_ARGS)
        assert p.returncode == 3, p.stderr
        assert p.stdout == "" and len(p.stderr.strip().splitlines()) == 1 and expected in p.stderr
        assert "Traceback" not in p.stderr


@pytest.mark.smoke
def test_cli_runs_two_steps_one_line_each():
    p = _run("--device", "cpu", *GUIDE_ARGS)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("step 1/2  loss ")
    assert "logp.backward fallback (tensor on cpu)" in lines[0]
    assert all("rollout_logprobs raw  sampler_gap 0 " in line for line in lines)  # the default


@pytest.mark.smoke
def test_cli_processed_rollout_logprobs_two_steps():
    p = _run("--device", "cpu", "--rollout-logprobs", "processed", "--top-k", "4", "--top-p", "0.9", *GUIDE_ARGS)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 2 and all("rollout_logprobs processed  sampler_gap 0 " in line for line in lines)


@pytest.mark.smoke
def test_cli_bad_input_is_one_line_exit_2(capsys):
    spec = importlib.util.spec_from_file_location("grpo_single_gpu", SCRIPT)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)  # in-process: one interpreter start for all the cases
    for bad in (["--top-p", "0"], ["--steps", "0"], ["--bogus"], ["--vocab-size", "1"],
                ["--require-fused-logp", "--logp-backend", "native"], ["--rollout-logprobs", "both"]):
        assert cli.main(["--device", "cpu", *bad]) == 2, bad
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and err.startswith("grpo_single_gpu: "), (bad, err)
        if bad[0] == "--rollout-logprobs":
            assert "--rollout-logprobs" in err and "raw" in err and "processed" in err, err


@pytest.mark.smoke
def test_cli_compare_backends_on_cpu():
    p = _run("--device", "cpu", "--compare-backends", *GUIDE_ARGS)
    assert p.returncode == 0, p.stderr
    assert "|diff| 0  bound" in p.stdout and "largest loss difference 0 at step" in p.stdout


@pytest.mark.smoke
def test_grpo_step_workload_runs_one_step_and_checks():
    wl = workloads.get("grpo-step")
    assert wl.fused_ops == ("sample", "logp.forward", "logp.backward") and wl.has_backward
    shape = workloads.Shape(batch_size=6, seq_len=3, vocab_size=32)
    inp = wl.make_inputs(shape, torch.float32, "cpu", 0)
    assert inp["cfg"].batch_size == 6 and inp["cfg"].completion_len == 3  # 3 prompts x 2 samples
    r = wl.repetition(inp)
    assert torch.isfinite(torch.tensor(r.loss)) and r.logp_backward[0] == "fallback"
    assert wl.check(inp) is None
    assert wl.bytes_moved(shape, torch.float32) > 12 * shape.rows * shape.vocab_size * 4
    assert wl.flops(shape, torch.float16) == wl.flops(shape, torch.float32) > 0


@pytest.mark.smoke
def test_groups_of_one_are_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="samples-per-prompt must be >= 2"):
        GRPOConfig(samples_per_prompt=1).validate()
    w = workloads.get("grpo-step")
    assert "even batch size" in w.shape_error(workloads.Shape(3, 4, 16))
    assert w.shape_error(workloads.Shape(4, 4, 16)) is None
    for cmd in ([sys.executable, "scripts/run_profile_suite.py", "--device", "cpu", "--workloads", "grpo-step",
                 "--batch-sizes", "3", "--seq-lens", "2", "--vocab-sizes", "16", "--output-dir", str(tmp_path)],
                [sys.executable, "-m", "pipelines.capture", "--workload", "grpo-step", "--batch-size", "3",
                 "--device", "cpu", "--output-dir", str(tmp_path)],
                [sys.executable, "examples/grpo_single_gpu.py", "--device", "cpu", "--samples-per-prompt", "1"]):
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        assert out.returncode == 2, (cmd, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert list(tmp_path.iterdir()) == []
