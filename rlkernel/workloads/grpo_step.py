"""The grpo-step family: one full GRPO training step (``rlkernel.grpo``, the example's own code).

The one module of the registry that imports the trainer, inside the functions that need it: importing the
registry imports neither the trainer nor the ops.
"""
from __future__ import annotations

from rlkernel.workloads.common import _size
from rlkernel.workloads.registry import Shape, Workload

# Shape mapping: batch_size = sequences (prompts x samples per prompt), seq_len = completion length,
# vocab_size = the policy's vocabulary. Fixed: prompt_len 4 (the prompt only conditions the rollout) and
# hidden_dim 64 (small, so the vocabulary-sized logits, which rlkernel owns, dominate the step).
_GRPO_PROMPT_LEN, _GRPO_HIDDEN = 4, 64


def _grpo_shape_error(s: Shape) -> str | None:
    # a group of one sample has zero advantage: the traced step would have no policy gradient
    if s.batch_size % 2:
        return f"grpo-step needs an even batch size (groups of >= 2 samples per prompt), got {s.batch_size}"
    return None


def _grpo_config(s: Shape, dtype, seed: int):
    import math

    from rlkernel.grpo import GRPOConfig

    error = _grpo_shape_error(s)
    if error:
        raise ValueError(error)
    group = math.gcd(s.batch_size, 4)  # 4 samples per prompt when batch_size allows, else 2
    return GRPOConfig(num_prompts=s.batch_size // group, samples_per_prompt=group, prompt_len=_GRPO_PROMPT_LEN,
                      completion_len=s.seq_len, vocab_size=s.vocab_size, hidden_dim=_GRPO_HIDDEN,
                      temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=seed, dtype=dtype)


def _grpo_inputs(s: Shape, dtype, device, seed):
    from rlkernel.grpo import Trainer

    cfg = _grpo_config(s, dtype, seed)
    return {"cfg": cfg, "device": device, "trainer": Trainer(cfg, device, logp_backend="auto")}


def _grpo_step(inp):
    return inp["trainer"].step()  # rollout (rlkernel.sample), forward, backward (rlkernel.logp), AdamW step


def _compare_grpo(inp) -> str | None:
    """One step from the same seed with auto and with native logp: the losses must agree within step_bound."""
    from rlkernel.grpo import compare_backends

    c = next(compare_backends(inp["cfg"], inp["device"], 1, logp_backend="auto"))
    if c.diff <= c.bound:
        return None
    return f"grpo-step: |loss(auto) - loss(native)| {c.diff:.3g} > bound {c.bound:.3g} (rlkernel.grpo.step_bound)"


def _grpo_bytes(s: Shape, dtype) -> int:
    # The vocabulary-sized tensors of one step, R = batch * completion rows of V logits in the logits' dtype:
    # rollout head writes + sampler reads (its processed log-probs come out of that read: docs/contracts.md,
    # section 1) + the rollout's raw logp reads (3), policy head writes per position +
    # stack copy (read, write) + logp forward reads (4), reference head writes + logp reads (2), logp backward
    # reads logits, writes their gradient, the head's backward reads it (3): 12 passes (rollout_logprobs "raw",
    # the default; "processed" adds a second policy logp). Plus the float32 head weight (V x H): read
    # by C rollout GEMMs, 2 forwards and the backward, its gradient written, AdamW reads p, g, m, v and writes
    # p, m, v; the embedding (V x H) gets a dense gradient and the same AdamW traffic. O(R*H) terms are left out.
    R, V, H = s.rows, s.vocab_size, _GRPO_HIDDEN
    weight = V * H * 4
    return 12 * R * V * _size(dtype) + weight * (s.seq_len + 3 + 1 + 7) + weight * (1 + 7)


def _grpo_flops(s: Shape, dtype) -> int:
    # head GEMMs 2*R*H*V each: rollout, policy and reference forwards, two backward GEMMs (5); the softmax
    # passes at 5 flops per logit: sampler (its processed log-probs included: the kept set's mass is summed in
    # the same pass, over the few kept tokens), the rollout's raw logp, policy and reference logp forwards, logp
    # backward (5).
    R, V, H = s.rows, s.vocab_size, _GRPO_HIDDEN
    return 5 * 2 * R * H * V + 5 * 5 * R * V


def workloads(path: str, backend: str) -> list[Workload]:
    """This family's workloads of one path: the one step, on the fused path only (its check runs native too)."""
    if path != "fused":
        return []
    return [Workload(
        name="grpo-step", op="grpo-step", path="fused", backend="auto",
        fused_ops=("sample", "logp.forward", "logp.backward"),
        description="one full GRPO step (rlkernel.grpo): rollout with rlkernel.sample, logp forward and backward, "
                    "AdamW; batch = sequences, seq_len = completion length",
        build=_grpo_inputs, step=_grpo_step, count_bytes=_grpo_bytes, count_flops=_grpo_flops,
        compare=_compare_grpo, has_backward=True, check_shape=_grpo_shape_error)]
