"""rlkernel.integrations.trl.apply(loss=True) against the real TRL: GRPOTrainer.compute_loss over a tiny random
Qwen2 GRPOTrainer (CPU, float32 weights; generated completions, left-padded prompts, right-padded completions) gives
TRL's own loss (1e-5 relative), gradients (1e-4 relative norm, every parameter) and logged metrics, for every fused
option, in one linear_logp_loss call and without TRL's head running; vLLM's importance-sampling ratio (crafted:
vLLM cannot be installed here) is applied as TRL applies it, which a loss that drops it fails; the options it
does not fuse go to TRL's own loss with the reason recorded. Skipped without trl; required in `tox -e trl`."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "examples"))
from integration_support import framework  # noqa: E402

trl = framework("trl", "trl")

import trl_grpo  # noqa: E402
from trl.kernels import chunked_logprob  # noqa: E402

import rlkernel  # noqa: E402
from rlkernel import dispatch  # noqa: E402
from rlkernel.integrations import trl as rk_trl  # noqa: E402

LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4


@pytest.fixture(scope="module")
def grpo(tmp_path_factory):
    """A GRPOTrainer (beta > 0: a reference model) and one generated micro-batch, with old log-probs moved away
    from the policy's (ratios beyond the clip range both ways) and advantages of both signs."""
    import datasets
    import transformers as tf

    warnings.simplefilter("ignore", FutureWarning)
    folder = tmp_path_factory.mktemp("model")
    args = trl_grpo.build_parser().parse_args([])
    trl_grpo.save_tiny_model(folder, args, torch.float32)
    config = trl.GRPOConfig(
        output_dir=str(folder / "out"), max_steps=1, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, beta=0.1, entropy_coef=0.01, temperature=0.9, report_to="none",
        save_strategy="no", seed=0, use_cpu=True, bf16=False, disable_tqdm=True)
    trainer = trl.GRPOTrainer(model=str(folder), reward_funcs=trl_grpo.reward, args=config,
                              train_dataset=datasets.Dataset.from_dict({"prompt": trl_grpo.prompts(args)}),
                              processing_class=tf.PreTrainedTokenizerFast.from_pretrained(folder))
    inputs = trainer._generate_and_score_completions([{"prompt": p} for p in trl_grpo.prompts(args)[:4]])
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2  # set by the training loop; 2 shows its normalisation
    mask = inputs["completion_mask"]
    assert mask.sum(-1).min() < mask.shape[1] and (mask.sum(-1) > 0).all()  # a completion right-padded
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        logp, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], mask], 1), mask.shape[1])
    inputs["old_per_token_logps"] = logp + 0.4 * torch.randn(logp.shape, generator=g)
    inputs["advantages"] = torch.tensor([1.0, -0.7, 0.4, -1.2])
    return trainer, inputs


def configure(monkeypatch, trainer, **options):
    """Trainer options as GRPOTrainer keeps them (attributes read by _compute_loss)."""
    on_args = {"delta", "use_bias_correction_kl"}
    for name, value in options.items():
        monkeypatch.setattr(trainer.args if name in on_args else trainer, name, value)
    if "entropy_coef" in options:
        monkeypatch.setattr(trainer, "_entropy_bonus_enabled", options["entropy_coef"] != 0.0)


def compute(trainer, inputs):
    """GRPOTrainer.compute_loss and backward: the loss, every parameter's gradient, the metrics it logged."""
    model = trainer.model
    model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads, {k: list(v) for k, v in trainer._metrics["train"].items()}


def check_equal(ref, got):
    (ref_loss, ref_grads, ref_metrics), (loss, grads, metrics) = ref, got
    assert abs(loss - ref_loss) <= LOSS_RTOL * abs(ref_loss), (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        rel = ((grads[name] - g).norm() / g.norm().clamp_min(1e-30)).item()
        assert rel <= GRAD_RTOL, (name, rel)
    assert metrics.keys() == ref_metrics.keys()
    for k, v in ref_metrics.items():
        assert metrics[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k


def fused(trainer, inputs, monkeypatch):
    """compute() under apply(loss=True): one linear_logp_loss call, TRL's head never running."""
    tiles = []
    original = chunked_logprob._forward_tile
    monkeypatch.setattr(chunked_logprob, "_forward_tile", lambda *a, **k: tiles.append(1) or original(*a, **k))
    with rk_trl.apply(loss=True), dispatch.recording() as rec:
        got = compute(trainer, inputs)
    assert [(r.op, n) for r, n in rec.records] == [("linear_logp_loss", 1)], rec.records
    assert tiles == []
    return got


VLLM_MODES = {  # the ratio TRL's _generate_and_score_completions hands the loss for each vllm_importance_sampling_mode
    "token_truncate": lambda r: r.clamp(max=2.0),
    "token_mask": lambda r: r.masked_fill(r > 2.0, 0.0),
    "sequence_truncate": lambda r: r[:, :1].clamp(max=2.0),
    "sequence_mask": lambda r: r[:, :1].masked_fill(r[:, :1] > 2.0, 0.0),
}


@pytest.mark.parametrize("mode", sorted(VLLM_MODES))
def test_vllm_importance_sampling_ratio_is_applied_as_trl_applies_it(grpo, monkeypatch, mode):
    trainer, inputs = grpo
    raw = torch.linspace(0.1, 3.0, inputs["completion_ids"].numel()).view_as(inputs["old_per_token_logps"])
    ratio = VLLM_MODES[mode](raw[torch.randperm(raw.shape[0], generator=torch.Generator().manual_seed(2))])
    configure(monkeypatch, trainer, use_vllm=True, vllm_importance_sampling_correction=True,
              vllm_importance_sampling_mode=mode)
    ones = dict(inputs, importance_sampling_ratio=torch.ones_like(ratio))
    with_ratio = dict(inputs, importance_sampling_ratio=ratio)
    ref = compute(trainer, with_ratio)
    without = compute(trainer, ones)
    # the ratio matters: a loss that drops it is off by far more than the tolerance
    assert abs(without[0] - ref[0]) > 100 * LOSS_RTOL * abs(ref[0])
    check_equal(ref, fused(trainer, with_ratio, monkeypatch))
