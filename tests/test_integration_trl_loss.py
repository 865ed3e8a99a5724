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


def make_trainer(folder, device="cpu"):
    """A GRPOTrainer (beta > 0: a reference model) and one generated micro-batch, with old log-probs moved away
    from the policy's (ratios beyond the clip range both ways) and advantages of both signs."""
    import datasets
    import transformers as tf

    warnings.simplefilter("ignore", FutureWarning)
    args = trl_grpo.build_parser().parse_args([])
    trl_grpo.save_tiny_model(folder, args, torch.float32)
    config = trl.GRPOConfig(
        output_dir=str(folder / "out"), max_steps=1, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, beta=0.1, entropy_coef=0.01, temperature=0.9, report_to="none",
        save_strategy="no", seed=0, use_cpu=device == "cpu", bf16=False, disable_tqdm=True)
    trainer = trl.GRPOTrainer(model=str(folder), reward_funcs=trl_grpo.reward, args=config,
                              train_dataset=datasets.Dataset.from_dict({"prompt": trl_grpo.prompts(args)}),
                              processing_class=tf.PreTrainedTokenizerFast.from_pretrained(folder))
    inputs = trainer._generate_and_score_completions([{"prompt": p} for p in trl_grpo.prompts(args)[:4]])
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2  # set by the training loop; 2 shows its normalisation
    mask = inputs["completion_mask"]
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        logp, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], mask], 1), mask.shape[1])
    inputs["old_per_token_logps"] = logp + 0.4 * torch.randn(logp.shape, generator=g).to(logp.device)
    inputs["advantages"] = torch.tensor([1.0, -0.7, 0.4, -1.2], device=logp.device)
    return trainer, inputs


@pytest.fixture(scope="module")
def grpo(tmp_path_factory):
    trainer, inputs = make_trainer(tmp_path_factory.mktemp("model"))
    mask = inputs["completion_mask"]
    assert mask.sum(-1).min() < mask.shape[1] and (mask.sum(-1) > 0).all()  # a completion right-padded
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


FUSED_OPTIONS = {
    "grpo": dict(loss_type="grpo"),
    "bnpo": dict(loss_type="bnpo"),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "dapo": dict(loss_type="dapo"),  # num_items_in_batch normalisation
    "cispo": dict(loss_type="cispo", epsilon_high=1.5),
    "grpo_sequence": dict(loss_type="grpo", importance_sampling_level="sequence"),
    "dapo_sequence": dict(loss_type="dapo", importance_sampling_level="sequence"),
    "cispo_sequence": dict(loss_type="cispo", importance_sampling_level="sequence", epsilon_high=1.2),
    "two_sided_delta": dict(loss_type="dapo", epsilon_low=0.1, epsilon_high=0.3, delta=1.4),
    "beta_0_no_entropy": dict(loss_type="grpo", beta=0.0, entropy_coef=0.0),
    "beta_bias_corrected_kl": dict(loss_type="bnpo", beta=0.3, use_bias_correction_kl=True),
    "sequence_bias_corrected_kl": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.2,
                                       use_bias_correction_kl=True),
    "entropy_coef": dict(loss_type="dr_grpo", entropy_coef=0.05),
}


@pytest.mark.parametrize("case", sorted(FUSED_OPTIONS))
def test_every_fused_option_equals_trls_loss_gradients_and_metrics(grpo, monkeypatch, case):
    trainer, inputs = grpo
    configure(monkeypatch, trainer, **FUSED_OPTIONS[case])
    ref = compute(trainer, inputs)
    assert any(k.startswith("clip_ratio") or k == "cispo_clip_ratio" for k in ref[2])
    check_equal(ref, fused(trainer, inputs, monkeypatch))


INPUT_CASES = {
    "no_old_logps": lambda i: {k: v for k, v in i.items() if k != "old_per_token_logps"},
    "per_token_advantages": lambda i: dict(i, advantages=i["advantages"][:, None] * torch.linspace(
        0.5, 1.5, i["completion_ids"].shape[1])),
    "tool_mask": lambda i: dict(i, tool_mask=(torch.arange(i["completion_ids"].shape[1]) != 1).long().expand_as(
        i["completion_mask"]).clone()),
}


@pytest.mark.parametrize("case", sorted(INPUT_CASES))
def test_inputs_trl_may_hand_the_loss(grpo, monkeypatch, case):
    trainer, inputs = grpo
    crafted = INPUT_CASES[case](inputs)
    check_equal(compute(trainer, crafted), fused(trainer, crafted, monkeypatch))


def test_scored_rows_only_as_on_triton_devices_and_eval_mode(grpo, monkeypatch):
    """On CUDA TRL's forward passes only the scored rows to the head: the same loss from them (here forced on CPU),
    and eval mode's normalisation (no accumulation)."""
    from trl.trainer import utils as trl_utils

    trainer, inputs = grpo
    monkeypatch.setattr(trl_utils, "_use_triton", lambda device: True)
    check_equal(compute(trainer, inputs), fused(trainer, inputs, monkeypatch))
    trainer.model.eval()
    try:
        configure(monkeypatch, trainer, loss_type="grpo")
        model = trainer.model
        with rk_trl.apply(loss=True):
            got = trainer.compute_loss(model, inputs).item()
        assert got == pytest.approx(trainer.compute_loss(model, inputs).item(), rel=LOSS_RTOL)
    finally:
        trainer.model.train()


FALLBACKS = {
    "sapo": (dict(loss_type="sapo"), "loss_type='sapo' not fused (fused: grpo, bnpo, dr_grpo, dapo, cispo)"),
    "luspo": (dict(loss_type="luspo"), "loss_type='luspo' not fused (fused: grpo, bnpo, dr_grpo, dapo, cispo)"),
    "top_entropy_quantile": (dict(top_entropy_quantile=0.5), "top_entropy_quantile=0.5 not fused (its mask is a "
                                                             "quantile of the whole batch's entropies)"),
    "off_policy_mask": (dict(off_policy_mask_threshold=0.5), "off_policy_mask_threshold not fused"),
    "adaptive_entropy": (dict(use_adaptive_entropy=True), "use_adaptive_entropy not fused (the static entropy_coef "
                                                          "is)"),
}


@pytest.mark.parametrize("case", sorted(FALLBACKS))
def test_options_not_fused_go_to_trls_loss_with_the_reason(grpo, monkeypatch, case):
    trainer, inputs = grpo
    options, reason = FALLBACKS[case]
    configure(monkeypatch, trainer, **options)
    if case == "adaptive_entropy":
        monkeypatch.setattr(trainer, "_entropy_bonus_enabled", True)
        monkeypatch.setattr(trainer, "_last_world_entropy", 0.0)
        monkeypatch.setattr(trainer, "_entropy_window_stats", None)
    coef = trainer.entropy_coef
    ref = compute(trainer, inputs)
    # the adaptive controller moved its state: back to where the reference run started
    trainer.entropy_coef, trainer._entropy_window_stats = coef, None
    if case == "adaptive_entropy":
        trainer._last_world_entropy = 0.0
    with rk_trl.apply(loss=True), dispatch.recording() as rec, pytest.warns(rlkernel.FallbackWarning):
        got = compute(trainer, inputs)
    records = [r for r, _ in rec.records]
    assert records[0] == dispatch.Dispatch(rk_trl.OP, "auto", "framework", "fallback", reason)
    assert [r.op for r in records[1:]] == ["linear_logp.forward", "linear_logp.backward"]  # TRL's loss, our head
    check_equal(ref, got)


def test_a_head_rlkernel_cannot_compute_gives_trls_head_and_the_same_loss(grpo, monkeypatch):
    trainer, inputs = grpo
    monkeypatch.setattr(rk_trl, "fallback_reason", lambda *a, **k: "a head rlkernel cannot compute")
    ref = compute(trainer, inputs)
    with rk_trl.apply(loss=True), dispatch.recording() as rec, pytest.warns(rlkernel.FallbackWarning):
        got = compute(trainer, inputs)
    assert [(r.op, r.reason) for r, _ in rec.records] == [(rk_trl.OP, "a head rlkernel cannot compute")]
    check_equal(ref, got)


def test_a_zero3_head_is_fused_in_the_loss(grpo, monkeypatch):
    """A DeepSpeed ZeRO-3 head weight (what DeepSpeed sets on it, faked: no DeepSpeed here) goes to TRL's head for
    log-probs alone (linear_logp's backward would recompute outside TRL's gather), but the loss computes every
    gradient inside TRL's gather: fused."""
    trainer, inputs = grpo
    monkeypatch.setattr(trainer.model.lm_head.weight, "ds_id", 0, raising=False)
    check_equal(compute(trainer, inputs), fused(trainer, inputs, monkeypatch))


def test_apply_loss_needs_the_head_and_is_undone():
    original = trl.GRPOTrainer._compute_loss
    with pytest.raises(ValueError, match="loss=True needs head=True"):
        rk_trl.apply(loss=True, head=False)
    with rk_trl.apply(loss=True) as p:
        assert trl.GRPOTrainer._compute_loss is not original and p.options["loss"] is True
    assert trl.GRPOTrainer._compute_loss is original


def test_grpo_runs_with_apply_loss_match_trls_own(tmp_path, monkeypatch):
    """Whole training runs (3 steps, generation, the trainer's accumulation and num_items_in_batch): per-step
    losses and the gradients TRL hands the optimizer, with and without apply(loss=True)."""
    args = trl_grpo.build_parser().parse_args([])
    folder = tmp_path / "model"
    folder.mkdir()
    trl_grpo.save_tiny_model(folder, args, torch.float32)
    ref = trl_grpo.train(folder, args, torch.device("cpu"), torch.float32)
    with rk_trl.apply(loss=True), dispatch.recording() as rec:
        got = trl_grpo.train(folder, args, torch.device("cpu"), torch.float32)
    # per step: the reference model's log-probs (the head) and the loss
    assert {r.op: n for r, n in rec.records} == {"linear_logp.forward": args.steps, "linear_logp_loss": args.steps}
    assert trl_grpo.compare(ref, got, args, torch.float32) == []


def test_cast_lm_head_to_fp32_with_bf16_weights(tmp_path, monkeypatch):
    """A bf16 model with cast_lm_head_to_fp32: GRPOTrainer makes the head float32 (rlkernel then computes it in
    float32, as TRL); a head left in bf16 (add_fused_lm_head's cast over a bf16 weight) maps to bf16 operands with
    float32 logits (logits_dtype=torch.float32, issue 36): TRL's float32 loss, gradients to bf16 rounding."""
    import datasets
    import transformers as tf

    args = trl_grpo.build_parser().parse_args([])
    folder = tmp_path / "model"
    folder.mkdir()
    trl_grpo.save_tiny_model(folder, args, torch.bfloat16)
    config = trl.GRPOConfig(
        output_dir=str(folder / "out"), max_steps=1, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, beta=0.0, entropy_coef=0.01, temperature=0.9, report_to="none",
        save_strategy="no", seed=0, use_cpu=True, bf16=False, disable_tqdm=True, cast_lm_head_to_fp32=True,
        model_init_kwargs={"dtype": torch.bfloat16})
    trainer = trl.GRPOTrainer(model=str(folder), reward_funcs=trl_grpo.reward, args=config,
                              train_dataset=datasets.Dataset.from_dict({"prompt": trl_grpo.prompts(args)}),
                              processing_class=tf.PreTrainedTokenizerFast.from_pretrained(folder))
    inputs = trainer._generate_and_score_completions([{"prompt": p} for p in trl_grpo.prompts(args)[:4]])
    inputs["advantages"] = torch.tensor([1.0, -0.7, 0.4, -1.2])
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    head = trainer.model.lm_head
    assert head.weight.dtype == torch.float32 and trainer.model.model.norm.weight.dtype == torch.bfloat16
    check_equal(compute(trainer, inputs), fused(trainer, inputs, monkeypatch))
    head.to(torch.bfloat16)
    ref = compute(trainer, inputs)
    seen, op = [], rlkernel.linear_logp_loss
    monkeypatch.setattr(rlkernel, "linear_logp_loss", lambda h, w, *a, **k: seen.append(
        (h.dtype, w.dtype, k["logits_dtype"])) or op(h, w, *a, **k))
    with rk_trl.apply(loss=True), dispatch.recording() as rec:
        got = compute(trainer, inputs)
    assert seen == [(torch.bfloat16, torch.bfloat16, torch.float32)]
    assert [(r.op, r.status) for r, _ in rec.records] == [("linear_logp_loss", "fallback")]  # native on CPU
    assert got[0] == pytest.approx(ref[0], rel=LOSS_RTOL)
    for name, g in ref[1].items():
        assert ((got[1][name].float() - g.float()).norm() / g.float().norm()).item() <= 1e-2, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["dapo", "grpo_sequence", "cispo"])
def test_fused_loss_on_cuda_matches_trls(tmp_path, monkeypatch, case):
    """On CUDA: TRL's forward passes the scored rows only (Triton), the loss runs fused; float32 weights (TF32 in
    TRL's Triton head: a looser tolerance than on CPU)."""
    trainer, inputs = make_trainer(tmp_path, "cuda")
    configure(monkeypatch, trainer, **FUSED_OPTIONS[case])
    ref = compute(trainer, inputs)
    with rk_trl.apply(loss=True), dispatch.recording() as rec:
        got = compute(trainer, inputs)
    assert [(r.op, r.status, n) for r, n in rec.records] == [("linear_logp_loss", "fused", 1)]
    assert got[0] == pytest.approx(ref[0], rel=1e-3, abs=1e-6)
    for name, g in ref[1].items():
        assert ((got[1][name] - g).norm() / g.norm().clamp_min(1e-30)).item() <= 1e-2, name
    assert got[2].keys() == ref[2].keys()
    for k in ("entropy", "kl"):  # a clip ratio may count a token at the clip boundary differently under TF32
        assert got[2][k] == pytest.approx(ref[2][k], rel=1e-2, abs=1e-4), k


@pytest.mark.parametrize("find_unused", [True, False])
def test_under_ddp_the_loss_is_reduced_as_trls(grpo, monkeypatch, tmp_path, find_unused):
    """The model wrapped in DistributedDataParallel (one gloo rank; the Trainer's default find_unused_parameters is
    True without gradient checkpointing): DDP's forward runs around TRL's patched forward, its reducer finds the
    parameters from the forward's outputs and all-reduces their gradients in the backward of the fused loss."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    trainer, inputs = grpo
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(trainer.model, find_unused_parameters=find_unused)

        def run():
            trainer.model.zero_grad(set_to_none=True)
            loss = trainer.compute_loss(ddp, inputs)
            loss.backward()
            return loss.item(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}

        ref = run()
        with rk_trl.apply(loss=True):
            got = run()
        assert got[1].keys() == ref[1].keys()
        check_equal((ref[0], ref[1], {}), (got[0], got[1], {}))
    finally:
        dist.destroy_process_group()
