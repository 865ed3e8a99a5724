"""A small, real GRPO training step whose log-probs and gradients go through rlkernel.

The policy is deliberately tiny (embedding, one hidden layer, an LM head) so that the step's cost is the
vocabulary-sized work rlkernel owns: the rollout's ``rlkernel.sample`` calls and the training step's
``rlkernel.logp`` forward and backward. ``examples/grpo_single_gpu.py`` is a thin CLI over this module and the
``grpo-step`` workload runs ``Trainer.step`` (docs/contracts.md, section 4), so both trace the same code.

One rollout feeds one optimizer step, so the "old" policy of the ratio is the rollout's own parameters and
the sampler's log-probs serve as old log-probs; how far they are from the training log-probs of the same
tokens is reported as ``sampler_gap``.

The rollout records two log-probs per token: the raw one (under the unfiltered softmax(logits / T)) and the
processed one (under the top_k/top_p-filtered distribution the token was drawn from). ``rollout_logprobs``
picks which the ratio uses; the training log-probs are then the same kind (``rlkernel.logp`` without or with
the sampler's filters), so the ratio compares like with like and carries no log S term (S = the kept mass).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import rlkernel
from rlkernel import dispatch
from rlkernel.numerics import DTYPES, LOGP_TOLERANCE

ROLLOUT_LOGPROBS = ("raw", "processed")  # GRPOConfig.rollout_logprobs / --rollout-logprobs
EOS = 0  # token id that ends a completion; later tokens are masked out of the loss
IGNORE = -100  # ignore_index handed to rlkernel.logp for masked positions


@dataclass(frozen=True)
class GRPOConfig:
    num_prompts: int = 4
    samples_per_prompt: int = 4
    prompt_len: int = 8
    completion_len: int = 16
    vocab_size: int = 128
    hidden_dim: int = 32
    lr: float = 1e-2
    clip_eps: float = 0.2
    beta: float = 0.04
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    # which rollout log-probs the importance ratio uses (and so which training log-probs): "raw" (unfiltered
    # softmax(logits / T)) or "processed" (the top_k/top_p-filtered distribution the token was drawn from)
    rollout_logprobs: str = "raw"
    dtype: torch.dtype = torch.float32  # of the logits (the LM head runs in it; master weights stay float32)

    @property
    def batch_size(self) -> int:
        """Sequences per step: every prompt is sampled ``samples_per_prompt`` times (one group per prompt)."""
        return self.num_prompts * self.samples_per_prompt

    @property
    def logp_temperature(self) -> float:
        # sample() reports raw log-probs at T = 1 for greedy (T = 0) decoding; training must use the same T
        return self.temperature if self.temperature > 0 else 1.0

    @property
    def processed_logp_args(self) -> dict:
        """rlkernel.logp's arguments for the processed log-probs: the sampler's own temperature and filters (T = 0
        stays 0 there: log-prob 0 for the argmax, docs/contracts.md section 1)."""
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}

    def validate(self) -> None:
        """Raise ValueError with one line naming the first bad setting."""
        for name in ("num_prompts", "samples_per_prompt", "prompt_len", "completion_len", "hidden_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.samples_per_prompt < 2:  # a group of one has zero advantage: nothing to learn from the policy loss
            raise ValueError(f"samples-per-prompt must be >= 2 (GRPO normalises within a group), "
                             f"got {self.samples_per_prompt}")
        if self.vocab_size < 2:
            raise ValueError(f"vocab-size must be >= 2 (token {EOS} is the end of a completion), got {self.vocab_size}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not self.clip_eps >= 0:
            raise ValueError(f"clip-eps must be >= 0, got {self.clip_eps}")
        if not self.beta >= 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.rollout_logprobs not in ROLLOUT_LOGPROBS:
            raise ValueError(f"rollout-logprobs must be one of {', '.join(ROLLOUT_LOGPROBS)}, "
                             f"got {self.rollout_logprobs!r}")
        if self.dtype not in DTYPES.values():
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype}")


class Policy(torch.nn.Module):
    """Causal toy LM: position i sees token i plus the running mean of tokens 0..i, then tanh(W x), then the head."""

    def __init__(self, vocab_size: int, hidden_dim: int, seed: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, hidden_dim)
        self.hidden = torch.nn.Linear(hidden_dim, hidden_dim)
        self.head = torch.nn.Linear(hidden_dim, vocab_size, bias=False)
        # Seeded on the CPU so that a seed gives the same initial policy on every device.
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / max(1, p.shape[-1]) ** 0.5)

    def features(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, n) ids -> (B, n, H); position i depends only on tokens 0..i (a cumulative sum along the sequence)."""
        e = self.embed(tokens)
        count = torch.arange(1, tokens.shape[1] + 1, device=tokens.device, dtype=e.dtype).unsqueeze(-1)
        return torch.tanh(self.hidden(e + e.cumsum(1) / count))

    def logits(self, h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The LM head in the logits' dtype (float32 accumulation in the GEMM), as mixed-precision training does."""
        return F.linear(h.to(dtype), self.head.weight.to(dtype))

    def logits_per_position(self, h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(B, C, H) -> (B, C, V), one head GEMM per position, each the very call the rollout made for that position.

        One GEMM over all B*C rows would round differently from the rollout's B-row GEMMs (measured on CPU: logits
        apart by ~6e-8, log-probs by ~2e-7), and the sampler-vs-training gap would then measure GEMM blocking, not
        the log-prob paths. The price is C launches and one copy of the logits (counted in the workload's bytes).
        """
        return torch.stack([self.logits(h[:, t], dtype) for t in range(h.shape[1])], 1)


@dataclass
class Rollout:
    prompts: torch.Tensor  # (B, P), each prompt repeated samples_per_prompt times (rows of one group adjacent)
    completions: torch.Tensor  # (B, C) sampled ids
    mask: torch.Tensor  # (B, C) bool: tokens up to and including the first EOS
    sampler_logp: torch.Tensor  # (B, C) float32: the one of the two below that training uses (cfg.rollout_logprobs)
    sampler_logp_raw: torch.Tensor  # (B, C) float32 drawn token's log-prob under the unfiltered softmax(logits / T')
    sampler_logp_processed: torch.Tensor  # (B, C) float32 ... under the filtered distribution it was drawn from
    rewards: torch.Tensor  # (B,) float32
    advantages: torch.Tensor  # (B,) float32
    sample_records: list = field(default_factory=list)  # dispatch records of the rollout's sample() calls


@dataclass
class StepResult:
    loss: float
    policy_loss: float
    kl: float
    mean_reward: float
    logp_forward: tuple[str, str]  # (status, reason) of the training logp.forward calls (worst if several)
    logp_backward: tuple[str, str]
    sample: tuple[str, str]
    sampler_gap: float  # max |sampler log-prob - training log-prob| over completion tokens, same params, T, kind
    grad_weight: float  # max over tokens of |d loss / d logp_t| (weights of the loss in the log-probs)
    max_abs_logp: float  # max |training log-prob| over completion tokens
    records: list = field(default_factory=list)  # (Dispatch, count) of the training forward+backward
    # with measure_native: max |logp - native logp| over completion tokens on these very logits (0 if native ran)
    logp_delta: float = 0.0
    lse_scale: float = 0.0  # max |logit / T| + log V: bounds |log-sum-exp|, the scale of a logp's rounding error
    rollout_logprobs: str = "raw"  # which log-probs the ratio used (GRPOConfig.rollout_logprobs)


def completion_mask(completions: torch.Tensor) -> torch.Tensor:
    """True up to and including the first EOS of each row (the EOS is an action the policy took)."""
    is_eos = (completions == EOS).long()
    eos_before = is_eos.cumsum(1) - is_eos  # EOS tokens strictly before each position
    return eos_before == 0


def synthetic_reward(prompts: torch.Tensor, completions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Fraction of completion tokens whose parity matches the prompt's last token: dense, deterministic, learnable."""
    match = (completions % 2) == (prompts[:, -1:] % 2)
    m = mask.float()
    return (match.float() * m).sum(1) / m.sum(1)  # m.sum(1) >= 1: the first token is always in the mask


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(r - group mean) / group std; a group whose rewards are all equal gets exactly 0 (no signal, never NaN)."""
    r = rewards.view(-1, group_size)
    mean = r.mean(1, keepdim=True)
    std = r.std(1, keepdim=True, unbiased=False)  # population std: defined for a group of one
    # Tested on the spread rather than std > 0: the mean of equal floats can differ from them in the last bit.
    constant = (r.amax(1, keepdim=True) - r.amin(1, keepdim=True)) == 0
    adv = torch.where(constant, torch.zeros_like(r), (r - mean) / torch.where(constant, torch.ones_like(std), std))
    return adv.reshape(-1)


def _status(records, op: str) -> tuple[str, str]:
    recs = [r for r, _ in records if r.op == op]
    status = dispatch.worst(r.status for r in recs)
    if status is None:
        return ("none", "not called")
    return status, next(r.reason for r in recs if r.status == status)


@torch.no_grad()
def rollout(policy: Policy, cfg: GRPOConfig, generator: torch.Generator, device: torch.device) -> Rollout:
    """Sample completion_len tokens per sequence with rlkernel.sample, then reward and group-normalise."""
    B, P, C = cfg.batch_size, cfg.prompt_len, cfg.completion_len
    prompts = torch.randint(1, cfg.vocab_size, (cfg.num_prompts, P), generator=generator, device=device)
    prompts = prompts.repeat_interleave(cfg.samples_per_prompt, dim=0)
    # The features run over the whole fixed-size buffer every step (unwritten positions hold EOS; causality makes
    # them invisible to earlier positions), so their shapes, and thus their rounding, match the training forward.
    buf = torch.full((B, P + C - 1), EOS, dtype=torch.long, device=device)
    buf[:, :P] = prompts
    ids, raw, processed = [], [], []
    with dispatch.recording() as rec:  # this rollout's sample (and raw logp.forward) records
        for t in range(C):
            h = policy.features(buf)[:, P - 1 + t]
            logits = policy.logits(h, cfg.dtype)
            # One draw gives both log-probs: sample() returns the processed one (bitwise rlkernel.logp with the
            # same filters), and the raw one is rlkernel.logp on the same logits, ids and T' (1 where T = 0) on the
            # same backend ("auto" both): what return_logprobs=True returns, bitwise natively, within the contract's
            # bound on the fused path (docs/contracts.md, section 1), where True comes from the sampler's own pass.
            tok, lp = rlkernel.sample(logits, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                                      generator=generator, return_logprobs="processed")
            ids.append(tok)
            processed.append(lp)
            raw.append(rlkernel.logp(logits, tok, temperature=cfg.logp_temperature))
            if P + t < buf.shape[1]:
                # a row without a distribution draws -1 (in the device error record, raised at the step's check):
                # the buffer feeds an embedding, which must not index -1 (a device assert would end the process)
                buf[:, P + t] = tok.clamp(min=0)
    completions = torch.stack(ids, 1)
    mask = completion_mask(completions)
    rewards = synthetic_reward(prompts, completions, mask)
    raw, processed = torch.stack(raw, 1).float(), torch.stack(processed, 1).float()
    used = processed if cfg.rollout_logprobs == "processed" else raw
    return Rollout(prompts, completions, mask, used, raw, processed, rewards,
                   group_advantages(rewards, cfg.samples_per_prompt), rec.records)


@dataclass
class LossTerms:
    """What ``Trainer.loss_terms`` computes: the loss and the tensors ``train_step`` reports from."""
    loss: torch.Tensor
    policy_loss: torch.Tensor
    kl: torch.Tensor
    lp: torch.Tensor  # (B, C) float32 policy log-probs of the ratio, cfg.rollout_logprobs' kind (0 at masked)
    lp_raw: torch.Tensor  # (B, C) float32 raw policy log-probs of the KL (the very tensor lp in "raw" mode)
    logits: torch.Tensor  # (B * C, V) the policy's logits
    ids: torch.Tensor  # (B, C) completion ids, IGNORE at masked positions
    ratio: torch.Tensor
    adv: torch.Tensor
    clipped: torch.Tensor
    d: torch.Tensor  # ref - lp_raw


class Trainer:
    """A policy, its frozen reference copy and an optimizer; ``train_step`` runs one GRPO update on a rollout."""

    def __init__(self, cfg: GRPOConfig, device, *, logp_backend: str = "auto", require_fused: bool = False):
        cfg.validate()
        self.cfg, self.device = cfg, torch.device(device)
        self.logp_backend, self.require_fused = logp_backend, require_fused
        self.policy = Policy(cfg.vocab_size, cfg.hidden_dim, cfg.seed).to(self.device)
        self.reference = copy.deepcopy(self.policy).requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=cfg.lr, weight_decay=0.0)
        self.generator = torch.Generator(device=self.device).manual_seed(cfg.seed + 1)

    def _logits(self, model: Policy, ro: Rollout) -> torch.Tensor:
        cfg = self.cfg
        seq = torch.cat([ro.prompts, ro.completions[:, :-1]], 1)
        h = model.features(seq)[:, cfg.prompt_len - 1:]  # the positions that predict the completion tokens
        return model.logits_per_position(h, cfg.dtype).reshape(-1, cfg.vocab_size)

    def _logp(self, logits: torch.Tensor, ids: torch.Tensor, *, processed: bool, backend: str | None = None):
        """Raw (T' as the sampler's raw log-probs) or processed (the sampler's filters) log-probs, shaped as ids."""
        cfg = self.cfg
        kind = cfg.processed_logp_args if processed else {"temperature": cfg.logp_temperature}
        if backend is None:
            backend, strict = self.logp_backend, self.require_fused
        else:
            strict = False
        lp = rlkernel.logp(logits, ids.reshape(-1), **kind, ignore_index=IGNORE, backend=backend,
                           require_fused=strict)
        return lp.view(ids.shape)

    def loss_terms(self, ro: Rollout) -> LossTerms:
        """The GRPO loss of the policy on a fixed rollout, forward only: no optimizer step, no host sync (a CUDA
        graph can capture it with its backward)."""
        cfg, mask = self.cfg, ro.mask
        ids = torch.where(mask, ro.completions, torch.full_like(ro.completions, IGNORE))
        zero = torch.zeros((), device=self.device)
        # masked positions: logp gives 0 there, so old/ref are zeroed too (no exp overflow from a masked token)
        old = torch.where(mask, ro.sampler_logp, zero)
        processed = cfg.rollout_logprobs == "processed"
        # The KL to the reference stays on raw log-probs in both modes: a filtered reference gives -inf for a
        # token outside its own kept set (an infinite k3 term), and the KL of the unfiltered policies is the
        # regulariser GRPO means. With "processed" the ratio's log-probs are a second logp call on the same logits.
        with torch.no_grad():
            ref = self._logp(self._logits(self.reference, ro), ids, processed=False)
        logits = self._logits(self.policy, ro)
        lp_raw = self._logp(logits, ids, processed=False)
        lp = self._logp(logits, ids, processed=True) if processed else lp_raw
        ratio = torch.exp(lp - old)
        adv = ro.advantages.unsqueeze(1)
        clipped = ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps)
        policy_tok = -torch.minimum(ratio * adv, clipped * adv)
        d = ref - lp_raw
        kl_tok = torch.exp(d) - d - 1  # k3 estimator of KL(policy || reference): >= 0, unbiased
        m = mask.float()
        n = m.sum(1)
        # per-sequence masked mean over completion tokens, then the mean over sequences (GRPO)
        policy_loss = ((policy_tok * m).sum(1) / n).mean()
        kl = ((kl_tok * m).sum(1) / n).mean()
        return LossTerms(policy_loss + cfg.beta * kl, policy_loss, kl, lp, lp_raw, logits, ids, ratio, adv, clipped,
                         d)

    def train_step(self, ro: Rollout, *, measure_native: bool = False) -> StepResult:
        cfg, mask = self.cfg, ro.mask
        zero = torch.zeros((), device=self.device)
        with dispatch.recording() as rec:  # the training step's own records (forward, backward)
            t = self.loss_terms(ro)
            loss, policy_loss, kl, lp, logits, ids = t.loss, t.policy_loss, t.kl, t.lp, t.logits, t.ids
            ratio, adv, clipped, d = t.ratio, t.adv, t.clipped, t.d
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()  # through rlkernel.logp's backward (the fused kernel when logp.forward ran fused)
            # bad input of the rollout or the forward raises here, before NaN gradients reach the weights (the
            # step's one sync: the optimizer and the report below read what this waited for)
            rlkernel.check_errors(self.device)
            self.optimizer.step()
        with torch.no_grad():
            gap = (lp.detach() - ro.sampler_logp).abs()[mask].max()  # the same kind on both sides
            # |d loss_token / d logp|: the ratio term (0 where the clip is active) plus the k3 term; each token's
            # loss enters the total with weight 1 / (n_seq * n_tokens_of_its_seq). With "processed" the two terms
            # hang on two log-probs of the token; their sum still bounds the loss's move when each log-prob moves
            # by at most logp_delta (the larger of the two kinds' deltas, below).
            unclipped = (ratio * adv <= clipped * adv) | (ratio == clipped)
            dterm = torch.where(unclipped, ratio * adv.abs(), zero) + cfg.beta * (1 - torch.exp(d)).abs()
            grad_weight = dterm[mask].max()
            max_abs_lp = lp.detach().abs()[mask].max()
        records = rec.records
        delta, scale = 0.0, 0.0
        if measure_native:  # after records were taken: not a training call (the logits predate the update)
            with torch.no_grad():
                x = logits.detach()
                delta = float((t.lp_raw.detach() - self._logp(x, ids, processed=False, backend="native"))
                              .abs()[mask].max())
                if cfg.rollout_logprobs == "processed":
                    nat = self._logp(x, ids, processed=True, backend="native")
                    delta = max(delta, float((lp.detach() - nat).abs()[mask].max()))
                scale = float(logits.detach().abs().max()) / cfg.logp_temperature + math.log(cfg.vocab_size)
        result = StepResult(float(loss.detach()), float(policy_loss.detach()), float(kl.detach()),
                          float(ro.rewards.mean()),
                          _status(records, "logp.forward"), _status(records, "logp.backward"),
                          _status(ro.sample_records, "sample"), float(gap), float(grad_weight), float(max_abs_lp),
                          records, delta, scale, cfg.rollout_logprobs)
        return result

    def step(self) -> StepResult:
        """One full GRPO step: rollout under the current parameters, then one update on it."""
        return self.train_step(rollout(self.policy, self.cfg, self.generator, self.device))


def compare_tolerance() -> tuple[float, float]:
    """(atol, rtol) per token between the fused and native logp: the one the logp workloads check against."""
    return LOGP_TOLERANCE


ROUNDING_ULPS = 8  # exp, log, the division by T and the final subtraction: each at most ~2 ulps of the lse scale


def step_bound(results: list[StepResult]) -> float:
    """How much one step's losses of the two runs may differ through that step's log-probs.

    The per-token difference delta of the two logp backends is measured on the first run's logits
    (``logp_delta``), floored at ROUNDING_ULPS float32 ulps of the log-sum-exp scale: a backward that rounds
    differently while the forward happens to agree bitwise still perturbs the update. The loss is a mean of
    per-token terms with weights summing to 1 and slopes in logp at most ``grad_weight``, so it moves by at
    most grad_weight * delta (the larger of the two runs' weights: their parameters differ after step 1).
    """
    eps = torch.finfo(torch.float32).eps
    delta = max(max(r.logp_delta for r in results), ROUNDING_ULPS * eps * max(r.lse_scale for r in results))
    return max(r.grad_weight for r in results) * delta


# The bound of step k is the sum of step_bound over steps 0..k: each earlier step perturbed the parameters by
# the update such a log-prob difference causes; while lr * steps is small the loss is near-linear in those
# perturbations and they add, each no larger than a direct one (an assumption, stated with the bound; measured
# on CPU with torch.log_softmax as the second backend, the loss differences stayed >= 700x below it over 20 steps).


@dataclass
class CompareStep:
    index: int  # 0-based
    first: StepResult  # the run with the chosen logp backend (fused on a GPU with the extension)
    native: StepResult  # the run with backend="native"
    diff: float  # |first.loss - native.loss|
    bound: float  # sum of step_bound over steps 0..index


def compare_backends(cfg: GRPOConfig, device, steps: int, *, logp_backend: str = "auto",
                     require_fused: bool = False):
    """Train twice from the same seed on the same rollouts, with ``logp_backend`` and with native logp.

    The rollout of each step is drawn once, from the first run's policy, and both runs update on it, so the
    loss curves differ only through the log-prob backend (and what that difference did to earlier updates).
    Yields one CompareStep per step.
    """
    first = Trainer(cfg, device, logp_backend=logp_backend, require_fused=require_fused)
    native = Trainer(cfg, device, logp_backend="native")
    bound = 0.0
    for k in range(steps):
        ro = rollout(first.policy, cfg, first.generator, first.device)
        a, b = first.train_step(ro, measure_native=True), native.train_step(ro, measure_native=True)
        bound += step_bound([a, b])
        yield CompareStep(k, a, b, abs(a.loss - b.loss), bound)
