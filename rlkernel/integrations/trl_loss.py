"""GRPOTrainer's loss as one ``rlkernel.linear_logp_loss`` call: ``rlkernel.integrations.trl.apply(loss=True)``.

TRL 1.16's ``GRPOTrainer._compute_loss`` gets the per-token log-probs and entropies from the model's fused head,
then computes the policy loss from them in torch (autograd goes back through the head). Under ``loss=True`` the
trainer's ``_compute_loss`` is replaced by ``compute_loss`` below: it sets a ``Pending`` loss on rlkernel's head
(``rlkernel.integrations.trl.RlkernelHead``) and calls the model as TRL does, so TRL's patched forward (inside
DDP's / ZeRO's wrapper, whose hooks run) computes the backbone and hands the head's call to
``RlkernelHead.apply``, which runs the whole loss there, gradients of hidden states and head weight included, in
one ``linear_logp_loss`` call. The head returns the (detached) log-probs and entropies to TRL's forward, and the
metrics TRL logs (entropy, KL, clip ratios, policy loss) are computed from them exactly as TRL does.

``per_token_losses`` mirrors ``_compute_loss`` line by line for the fused options: the loss types ``grpo``,
``bnpo``, ``dr_grpo``, ``dapo``, ``cispo``; token- and sequence-level importance sampling (a sequence's weight
needs all its tokens, so every chunk of the op holds whole completions: ``chunk_size`` a multiple of the
completion length); ``epsilon_low`` / ``epsilon_high`` and ``delta``; ``beta`` > 0 with the reference log-probs
(``use_bias_correction_kl`` too); the static entropy bonus ``entropy_coef``; vLLM's importance-sampling ratio
(``inputs["importance_sampling_ratio"]``, token ``[B, T]`` or sequence ``[B, 1]``, already truncated or masked by
TRL's ``_generate_and_score_completions`` as ``vllm_importance_sampling_mode`` says); the ``num_items_in_batch``
normaliser of dapo / cispo. Everything else goes to TRL's own ``_compute_loss`` with the reason recorded
(``fallback_reason``; op ``integrations.trl``).

The op's rows are the completion window ``[B, T]`` of TRL's head rows (TRL passes every position, or on Triton
devices only the scored ones; either is mapped to the window, ignored rows where the label is -100).
"""
from __future__ import annotations

import dataclasses
from contextlib import nullcontext

import torch

FUSED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
# inputs of vision-language models: TRL's forward takes them, the completion window would not change, but the
# mapping is untested: TRL's own path
MULTIMODAL = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
              "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def fallback_reason(trainer, inputs) -> str | None:
    """Why this ``_compute_loss`` goes to TRL's own; None when the fused loss computes it."""
    if trainer.loss_type not in FUSED_LOSS_TYPES:
        return f"loss_type={trainer.loss_type!r} not fused (fused: {', '.join(FUSED_LOSS_TYPES)})"
    if trainer.importance_sampling_level not in ("token", "sequence"):
        return f"importance_sampling_level={trainer.importance_sampling_level!r} unknown"
    if trainer.top_entropy_quantile < 1.0:
        return (f"top_entropy_quantile={trainer.top_entropy_quantile} not fused (its mask is a quantile of the "
                f"whole batch's entropies)")
    if trainer.off_policy_mask_threshold is not None:
        return "off_policy_mask_threshold not fused"
    if trainer.use_adaptive_entropy:
        return "use_adaptive_entropy not fused (the static entropy_coef is)"
    if trainer.aux_loss_enabled:
        return "the MoE router aux loss not fused"
    present = [k for k in MULTIMODAL if inputs.get(k) is not None]
    if present:
        return f"multimodal inputs ({', '.join(present)}) not fused"
    return None


@dataclasses.dataclass
class Pending:
    """One micro-batch's loss, set on the head before the model's forward and filled in by it.

    Per-token tensors are ``[B, T]`` (T the completion length), float32 on the model's device: ``mask`` (TRL's
    completion mask, times the tool mask), ``advantages`` ``[B, 1]`` or ``[B, T]``, ``old`` (None: the current
    log-probs, detached, as TRL uses them when it skipped the old pass), ``ref`` (beta > 0), ``is_ratio`` vLLM's
    ratio ``[B, T]`` / ``[B, 1]`` or None, ``weight`` the loss type's normalisation of each token (the mask
    included), ``entropy_weight`` the entropy bonus' (None without a bonus)."""

    labels: torch.Tensor  # [B, T] completion ids, -100 where not scored by TRL's head
    scored: torch.Tensor  # [B, L - 1] bool: TRL's head rows (its label mask)
    mask: torch.Tensor
    advantages: torch.Tensor
    old: torch.Tensor | None
    ref: torch.Tensor | None
    is_ratio: torch.Tensor | None
    weight: torch.Tensor
    entropy_weight: torch.Tensor | None
    loss_type: str
    level: str
    epsilon_low: float
    epsilon_high: float
    delta: float | None
    beta: float
    bias_correction_kl: bool
    entropy_coef: float
    # filled in by the head
    loss: torch.Tensor | None = None
    logp: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


def policy_terms(p: Pending, lp: torch.Tensor, rows: slice):
    """TRL's per-token policy loss of the sequences ``rows`` (``lp`` their ``[n, T]`` log-probs), with the
    ``coef_1`` its clip metrics read and the per-token KL (None when beta == 0): ``_compute_loss`` up to the
    aggregation."""
    m, adv = p.mask[rows], p.advantages[rows]
    old = lp.detach() if p.old is None else p.old[rows]
    log_ratio = lp - old
    if p.level == "token":
        log_iw = log_ratio
    else:
        log_iw = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_iw)
    kl = None
    if p.beta != 0.0:
        ref = p.ref[rows]
        kl = torch.exp(ref - lp) - (ref - lp) - 1
        if p.bias_correction_kl:
            kl = kl * coef_1
    if p.loss_type == "cispo":
        per = -torch.clamp(coef_1, max=p.epsilon_high).detach() * adv * lp
    else:
        coef_2 = torch.clamp(coef_1, 1 - p.epsilon_low, 1 + p.epsilon_high)
        if p.delta is not None:
            coef_1 = torch.clamp(coef_1, max=p.delta)
        per = -torch.min(coef_1 * adv, coef_2 * adv)
    if p.is_ratio is not None:
        per = per * p.is_ratio[rows]
    if kl is not None:
        per = per + p.beta * kl
    return per, coef_1, kl


def per_token_losses(p: Pending, lp: torch.Tensor, ent: torch.Tensor, rows: slice) -> torch.Tensor:
    """The ``[n, T]`` per-token contributions to the micro-batch's loss (their sum is TRL's loss)."""
    per, _, _ = policy_terms(p, lp, rows)
    out = per * p.weight[rows]  # a sequence-level [n, 1] term broadcasts over the tokens, as in TRL's sums
    if p.entropy_weight is not None:
        out = out - p.entropy_coef * (ent * p.entropy_weight[rows])
    return out


def loss_fn_for(p: Pending, T: int):
    """``linear_logp_loss``'s loss_fn over chunks of whole completions; it keeps the detached log-probs and
    entropies for the metrics and the values TRL's forward returns."""
    def loss_fn(logp, entropy, sl):
        if sl.start % T or logp.numel() % T:  # chunk_rows makes whole completions: a broken invariant, not input
            raise RuntimeError(f"rlkernel.integrations.trl: a loss chunk {sl} splits a completion of {T} tokens")
        rows = slice(sl.start // T, sl.stop // T)
        lp, ent = logp.view(-1, T), entropy.view(-1, T)
        p.logp[rows] = lp.detach()
        p.entropy[rows] = ent.detach()
        return per_token_losses(p, lp, ent, rows).reshape(-1)
    return loss_fn


def chunk_rows(n_seq: int, T: int, vocab: int, itemsize: int) -> int:
    """Tokens per op chunk: about linear_logp_loss's default, rounded down to whole completions (at least one)."""
    from rlkernel.ops.linear_logp_loss import default_chunk

    per = default_chunk(n_seq * T, vocab, itemsize)
    return max(1, per // T) * T


def to_window(p: Pending, rows: torch.Tensor, fill=0.0) -> torch.Tensor:
    """TRL's head rows (every position ``[B * (L - 1), ...]`` or the scored ones only) as the completion window
    ``[B, T, ...]``; ``fill`` where TRL's head did not score."""
    B, T = p.labels.shape
    scored_win = p.scored[:, -T:]
    tail = rows.shape[1:]
    if rows.shape[0] == p.scored.numel():  # every position
        win = rows.view(B, -1, *tail)[:, -T:]
        if fill is not None and rows.dim() == 1:
            win = win.masked_fill(~scored_win, fill)
        return win
    out = rows.new_zeros(B, T, *tail)
    return out.masked_scatter(scored_win.view(B, T, *([1] * len(tail))), rows)


def from_window(p: Pending, win: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The inverse of to_window for TRL's forward: ``[B, T]`` values in the layout of TRL's head rows ``like``."""
    B, T = p.labels.shape
    if like.shape[0] == p.scored.numel():
        out = win.new_zeros(B, p.scored.shape[1])
        out[:, -T:] = win
        return out.view(-1)
    return win[p.scored[:, -T:]]


def fused_loss(p: Pending, hidden, weight, bias, temperature, outputs, options: dict):
    """The head's call with a pending loss: the loss by one ``linear_logp_loss`` call over the completion window
    (``p.loss``), and TRL's head outputs (detached log-probs and entropies in the layout of its rows)."""
    import rlkernel

    B, T = p.labels.shape
    rows = to_window(p, hidden, fill=None).reshape(B * T, hidden.shape[-1])
    itemsize = 4 if options.get("logits_dtype") is not None else hidden.element_size()
    p.loss = rlkernel.linear_logp_loss(rows, weight, p.labels.reshape(-1), loss_fn_for(p, T), bias=bias,
                                       temperature=temperature, chunk_size=chunk_rows(B, T, weight.shape[0], itemsize),
                                       **options)
    ent = from_window(p, p.entropy, hidden) if "entropy" in outputs else None
    # the log-probs TRL's forward returns hang on the loss' graph (by a zero): DDP with find_unused_parameters
    # finds the parameters from the forward's outputs, and would otherwise mark every one unused, then ready twice
    logp = from_window(p, p.logp, hidden) + p.loss * 0 if p.loss.requires_grad else from_window(p, p.logp, hidden)
    return logp, ent, None, None, None


def loss_from_rows(p: Pending, logp_rows, entropy_rows) -> None:
    """The pending loss from the per-token values of TRL's own head (a head rlkernel cannot compute): the same
    per-token formula in torch, autograd through TRL's head."""
    lp = to_window(p, logp_rows)
    ent = to_window(p, entropy_rows) if entropy_rows is not None else torch.zeros_like(lp)
    p.logp.copy_(lp.detach())
    p.entropy.copy_(ent.detach())
    p.loss = per_token_losses(p, lp, ent, slice(None)).sum()


def build(trainer, inputs) -> Pending:
    """The Pending loss of one micro-batch: ``_compute_loss``'s inputs and its normalisers as token weights."""
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    mask = mask.float()
    B, T = completion_ids.shape
    attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
    input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :-T] = -100
    scored = labels[:, 1:] != -100
    advantages = inputs["advantages"]
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    mode = "train" if trainer.model.training else "eval"
    accum = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
    lt = trainer.loss_type
    if lt == "grpo":
        weight = mask / mask.sum(-1, keepdim=True).clamp(min=1.0) / B / accum
    elif lt == "bnpo":
        weight = mask / mask.sum().clamp(min=1.0) / accum
    elif lt == "dr_grpo":
        weight = mask / (B * trainer.max_completion_length) / accum
    else:  # dapo, cispo: num_items_in_batch spans the generation batch, rescaled to one accumulation window
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
        if mode == "train":
            normalizer = normalizer * trainer.current_gradient_accumulation_steps / trainer.args.steps_per_generation
        weight = mask / normalizer
    entropy_weight = None
    if trainer._entropy_bonus_enabled:
        entropy_weight = mask / mask.sum().clamp(min=1.0) / accum
    use_is = trainer.use_vllm and trainer.vllm_importance_sampling_correction
    return Pending(
        labels=labels[:, -T:], scored=scored, mask=mask, advantages=advantages,
        old=inputs.get("old_per_token_logps"), ref=inputs["ref_per_token_logps"] if trainer.beta != 0.0 else None,
        is_ratio=inputs["importance_sampling_ratio"] if use_is else None, weight=weight,
        entropy_weight=entropy_weight, loss_type=lt, level=trainer.importance_sampling_level,
        epsilon_low=trainer.epsilon_low, epsilon_high=trainer.epsilon_high, delta=trainer.args.delta,
        beta=trainer.beta, bias_correction_kl=bool(trainer.args.use_bias_correction_kl),
        entropy_coef=trainer.entropy_coef)


def log_metrics(trainer, p: Pending, loss_mode_policy: torch.Tensor) -> None:
    """The metrics ``_compute_loss`` logs, from the head's detached log-probs and entropies, as TRL computes them."""
    from trl.trainer.utils import nanmax, nanmin

    mode = "train" if trainer.model.training else "eval"
    mask = p.mask
    metrics = trainer._metrics[mode]
    if trainer._entropy_bonus_enabled:
        metrics["policy_loss"].append(trainer.accelerator.gather(loss_mode_policy).nanmean().item())
        if mode == "train" and trainer.accelerator.sync_gradients:
            metrics["entropy_coef"].append(trainer.entropy_coef)

    def masked_seq_mean(x):
        if x.shape[1] == 1:
            return x.squeeze(1)
        return (x * mask).sum(-1) / mask.sum(-1)

    def global_masked_mean(x):
        if x.shape[1] == 1:
            local_sum, local_count = x.sum(), torch.tensor(float(x.shape[0]), device=x.device)
        else:
            local_sum, local_count = (x * mask).sum(), mask.sum().float()
        totals = trainer.accelerator.reduce(torch.stack([local_sum, local_count]), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    _, coef_1, kl = policy_terms(p, p.logp, slice(None))
    if kl is not None:
        metrics["kl"].append(global_masked_mean(kl))
    metrics["entropy"].append(global_masked_mean(p.entropy))
    adv = p.advantages
    if p.loss_type == "cispo":
        metrics["cispo_clip_ratio"].append(global_masked_mean(((coef_1 > p.epsilon_high) & (adv > 0)).float()))
        return
    low = (coef_1 < 1 - p.epsilon_low) & (adv < 0)
    high = (coef_1 > 1 + p.epsilon_high) & (adv > 0)
    metrics["clip_ratio/low_mean"].append(global_masked_mean(low.float()))
    metrics["clip_ratio/high_mean"].append(global_masked_mean(high.float()))
    metrics["clip_ratio/region_mean"].append(global_masked_mean((low | high).float()))
    metrics["clip_ratio/low_min"].append(nanmin(trainer.accelerator.gather(masked_seq_mean(low.float()))).item())
    metrics["clip_ratio/high_max"].append(nanmax(trainer.accelerator.gather(masked_seq_mean(high.float()))).item())


def policy_loss_value(trainer, p: Pending) -> torch.Tensor:
    """TRL's ``policy_loss`` metric (the loss before the entropy bonus, not divided by the accumulation steps for
    the loss types that divide by it), from the detached log-probs."""
    per, _, _ = policy_terms(p, p.logp, slice(None))
    value = (per * p.weight).sum()
    if p.loss_type in ("grpo", "bnpo", "dr_grpo") and trainer.model.training:
        value = value * trainer.current_gradient_accumulation_steps
    return value.detach()


def compute_loss(trainer, model, inputs, head, phase=None):
    """``GRPOTrainer._compute_loss`` through the fused loss (``head``: the active RlkernelHead; ``phase``: the
    policy_forward range, or None), for options ``fallback_reason`` passed."""
    p = build(trainer, inputs)
    prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :-completion_ids.size(1)] = -100
    B, T = completion_ids.shape
    p.logp = torch.zeros(B, T, dtype=torch.float32, device=completion_ids.device)
    p.entropy = torch.zeros_like(p.logp)
    head.pending = p
    try:
        with phase if phase is not None else nullcontext(), trainer.accelerator.autocast():
            model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
    finally:
        head.pending = None
    if p.loss is None:
        raise RuntimeError("rlkernel.integrations.trl: the model's forward did not call TRL's fused head (a model "
                           "without trl's add_fused_lm_head?)")
    log_metrics(trainer, p, policy_loss_value(trainer, p) if trainer._entropy_bonus_enabled else None)
    return p.loss
