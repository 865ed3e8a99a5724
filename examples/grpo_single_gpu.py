"""GRPO on one GPU with rlkernel: rollouts through rlkernel.sample, log-probs and gradients through rlkernel.logp.

A thin CLI over rlkernel.grpo (the same step the ``grpo-step`` workload runs). One line per step. Exit codes
(docs/contracts.md, section 5): 0 done; 1 a check failed (--require-fused-logp saw a non-fused dispatch, a
sampler/training log-prob gap or a --compare-backends loss difference beyond its stated bound); 2 bad usage;
3 this machine cannot run what was asked (no CUDA, fused logp unavailable under --require-fused-logp).
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

# Run from a checkout: the repository's rlkernel (with an in-place built extension) comes first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from rlkernel import FallbackWarning, FusedKernelUnavailable, dispatch  # noqa: E402
from rlkernel.cli import (  # noqa: E402
    EXIT_BLOCKED,
    EXIT_CHECK_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    OneLineParser,
    check_env_flags,
)
from rlkernel.grpo import (  # noqa: E402
    DTYPES,
    ROLLOUT_LOGPROBS,
    ROUNDING_ULPS,
    GRPOConfig,
    Trainer,
    compare_backends,
    compare_tolerance,
)

PROG = "grpo_single_gpu"
BUILD_HINT = "on a CUDA machine: python -m rlkernel.build builds it, python -m rlkernel.env says why it is not there"


def build_parser() -> argparse.ArgumentParser:
    d = GRPOConfig()
    p = OneLineParser(prog=PROG, description=__doc__.split("\n")[0],
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: cuda when available, else cpu")
    p.add_argument("--require-fused-logp", action="store_true",
                   help="exit 3 before training if fused logp cannot run here; exit 1 if the first step's "
                        "logp.forward or logp.backward did not run fused")
    p.add_argument("--logp-backend", choices=("auto", "fused", "native"), default="auto",
                   help="backend of the training rlkernel.logp calls")
    p.add_argument("--compare-backends", action="store_true",
                   help="train twice from the same seed on the same rollouts, with --logp-backend and with native "
                        "logp; print the loss difference per step and its bound (exit 1 beyond it, float32 logits)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="dtype of the logits")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--num-prompts", type=int, default=d.num_prompts)
    p.add_argument("--samples-per-prompt", type=int, default=d.samples_per_prompt, help="group size")
    p.add_argument("--prompt-len", type=int, default=d.prompt_len)
    p.add_argument("--completion-len", type=int, default=d.completion_len)
    p.add_argument("--vocab-size", type=int, default=d.vocab_size)
    p.add_argument("--hidden-dim", type=int, default=d.hidden_dim)
    p.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate")
    p.add_argument("--clip-eps", type=float, default=d.clip_eps, help="ratio clip: [1 - eps, 1 + eps]")
    p.add_argument("--beta", type=float, default=d.beta, help="weight of the k3 KL to the frozen reference")
    p.add_argument("--temperature", type=float, default=d.temperature, help="sampling and log-prob temperature")
    p.add_argument("--top-k", type=int, default=d.top_k, help="0 keeps every token")
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--rollout-logprobs", choices=ROLLOUT_LOGPROBS, default=d.rollout_logprobs,
                   help="the rollout records both; the importance ratio uses this kind, against training log-probs "
                        "of the same kind: raw = under the unfiltered softmax(logits / T) (T = 1 where T = 0), "
                        "processed = under the --top-k/--top-p-filtered distribution the token was drawn from (no "
                        "log S term in the ratio; at --temperature 0 they are 0, so no policy gradient); the KL to the "
                        "reference uses raw log-probs either way")
    p.add_argument("--seed", type=int, default=d.seed)
    return p


def _config(args) -> GRPOConfig:
    cfg = GRPOConfig(num_prompts=args.num_prompts, samples_per_prompt=args.samples_per_prompt,
                     prompt_len=args.prompt_len, completion_len=args.completion_len, vocab_size=args.vocab_size,
                     hidden_dim=args.hidden_dim, lr=args.lr, clip_eps=args.clip_eps, beta=args.beta,
                     temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                     rollout_logprobs=args.rollout_logprobs, dtype=DTYPES[args.dtype])
    try:
        cfg.validate()
    except ValueError as exc:
        raise CliError(f"--{exc}", EXIT_USAGE) from None
    if args.steps < 1:
        raise CliError(f"--steps must be >= 1, got {args.steps}", EXIT_USAGE)
    if args.require_fused_logp and args.logp_backend == "native":
        raise CliError("--require-fused-logp contradicts --logp-backend native", EXIT_USAGE)
    return cfg


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        why = "this torch has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise CliError(f"--device cuda: CUDA is not available ({why}, torch {torch.__version__})", EXIT_BLOCKED)
    return torch.device(name)


def _preflight(args, device, dtype) -> None:
    """Exit 3 before any work when the fused logp that was demanded cannot run here."""
    if not (args.require_fused_logp or args.logp_backend == "fused"):
        return
    flag = "--require-fused-logp" if args.require_fused_logp else "--logp-backend fused"
    for op in ("logp.forward", "logp.backward"):
        reason = dispatch.fused_unavailable_reason(op, device, dtype)
        if reason:
            hint = "run with --device cuda on a GPU" if device.type != "cuda" else BUILD_HINT
            raise CliError(f"{flag}: fused {op} cannot run: {reason} ({hint})", EXIT_BLOCKED)


def _fmt_status(status: tuple[str, str]) -> str:
    return f"{status[0]} ({status[1]})" if status[1] else status[0]


def _gap_check(result, dtype) -> tuple[str, bool]:
    """The sampler/training gap against the per-token fused-vs-native logp tolerance.

    Rollout and training compute bitwise the same logits (rlkernel.grpo.Policy.logits_per_position), so the gap
    is the log-prob paths' alone: 0 when both are native, else within the fused-vs-native logp tolerance.
    """
    atol, rtol = compare_tolerance()
    tol = atol + rtol * result.max_abs_logp
    ok = result.sampler_gap <= tol
    return f"sampler_gap {result.sampler_gap:.3g} (tol {tol:.2g} {'ok' if ok else 'EXCEEDED'})", ok


def _strict_check(result) -> None:
    # The training step's own dispatch records (its forward and backward), not the process history's.
    for op, status in (("logp.forward", result.logp_forward), ("logp.backward", result.logp_backward)):
        statuses = {r.status for r, _ in result.records if r.op == op}
        if statuses != {"fused"}:
            raise CliError(f"--require-fused-logp: {op} ran {_fmt_status(status)}, not fused", EXIT_CHECK_FAILED)


def _train(args, cfg, device) -> int:
    trainer = Trainer(cfg, device, logp_backend=args.logp_backend, require_fused=args.require_fused_logp)
    ok = True
    for k in range(args.steps):
        r = trainer.step()
        gap, gap_ok = _gap_check(r, cfg.dtype)
        ok &= gap_ok
        print(f"step {k + 1}/{args.steps}  loss {r.loss:.6g}  policy_loss {r.policy_loss:.6g}  kl {r.kl:.6g}  "
              f"reward {r.mean_reward:.4f}  logp.forward {_fmt_status(r.logp_forward)}  "
              f"logp.backward {_fmt_status(r.logp_backward)}  sample {_fmt_status(r.sample)}  "
              f"rollout_logprobs {r.rollout_logprobs}  {gap}", flush=True)
        if k == 0 and args.require_fused_logp:
            _strict_check(r)
    if not ok:
        raise CliError("sampler and training log-probs of the same tokens differ beyond the tolerance",
                       EXIT_CHECK_FAILED)
    return EXIT_OK


def _compare(args, cfg, device) -> int:
    # The bound is derived for float32 logits: with 16-bit logits the two backends' float32 gradients can round
    # to different 16-bit values, a perturbation the bound does not model; the curves are printed, not checked.
    checked = cfg.dtype == torch.float32
    largest, exceeded = None, False
    for c in compare_backends(cfg, device, args.steps, logp_backend=args.logp_backend,
                              require_fused=args.require_fused_logp):
        over = checked and c.diff > c.bound
        exceeded |= over
        verdict = "EXCEEDED" if over else ("ok" if checked else "not checked")
        print(f"step {c.index + 1}/{args.steps}  loss[{args.logp_backend}: {c.first.logp_forward[0]}/"
              f"{c.first.logp_backward[0]}] {c.first.loss:.9f}  loss[native] {c.native.loss:.9f}  "
              f"|diff| {c.diff:.3g}  bound {c.bound:.3g}  {verdict}  (logp delta {c.first.logp_delta:.2g}, "
              f"rollout_logprobs {c.first.rollout_logprobs})", flush=True)
        if c.index == 0 and args.require_fused_logp:
            _strict_check(c.first)
        if largest is None or c.diff > largest.diff:
            largest = c
    print(f"largest loss difference {largest.diff:.3g} at step {largest.index + 1} (bound there {largest.bound:.3g};"
          " bound of step k = sum over steps <= k of max|dloss/dlogp| * max(measured max|logp - native logp|,"
          f" {ROUNDING_ULPS} float32 ulps of max|logit/T| + log V); see rlkernel.grpo.step_bound)")
    if exceeded:
        raise CliError("the loss curves of the two logp backends differ beyond the stated bound", EXIT_CHECK_FAILED)
    return EXIT_OK


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        check_env_flags()  # a bad RLKERNEL_* value: one line, exit 2, before any step (not an EnvFlagError traceback)
        cfg = _config(args)
        device = _device(args.device)
        _preflight(args, device, cfg.dtype)
        warnings.simplefilter("ignore", FallbackWarning)  # every step line prints its dispatch and reason
        return (_compare if args.compare_backends else _train)(args, cfg, device)
    except FusedKernelUnavailable as exc:
        print(f"{PROG}: {exc} ({BUILD_HINT})", file=sys.stderr)
        return EXIT_BLOCKED
    except CliError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return exc.code


if __name__ == "__main__":
    sys.exit(main())
