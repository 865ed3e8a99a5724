"""GRPO on a transformers causal LM with rlkernel.linear_logp_loss, checked against the model's own logits path.

Default model: a Qwen2 config (hidden 896, 4 layers, vocabulary 151936), random weights, nothing downloaded. Each
step samples --prompts x --samples completions of --new-tokens tokens (KV cache, rlkernel.sample), rewards them
(rlkernel.grpo.synthetic_reward) into group advantages, then computes the same GRPO loss (PPO-clipped ratio against
the rollout policy's log-probs, minus --entropy-coef x entropy, mean over completion tokens, at --temperature) twice
on the same weights: the model's own path (``model(ids).logits`` -> float32 log_softmax -> gather, entropy) and
``rlkernel.linear_logp_loss`` on the last hidden states and ``lm_head.weight`` (never the N x V logits). The
optimizer steps on the rlkernel path's gradients. Checks per step: the losses agree within the bound printed beside
them (see ``loss_bound``); on CUDA the rlkernel path's peak memory is lower by at least the completion logits' size.
The rlkernel step runs inside the NVTX workload range ``grpo-hf-step`` (domain rlkernel); ``--manifest`` writes a
run manifest naming it (fused_ops: linear_logp_loss), so a capture of this script analyses with
``python -m pipelines.analyze RUN_DIR --require-fused``.

Exit codes (docs/contracts.md, section 5): 0 done; 1 a check failed (loss bound, memory drop, --require-fused saw a
non-fused linear_logp_loss); 2 bad usage; 3 this machine cannot run it (transformers missing, no CUDA with
--device cuda, fused path unavailable under --require-fused).
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
import warnings
from pathlib import Path

# Run from a checkout: the repository's rlkernel (with an in-place built extension) comes first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import rlkernel  # noqa: E402
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
from rlkernel.grpo import IGNORE, completion_mask, group_advantages, synthetic_reward  # noqa: E402
from rlkernel.nvtx_ranges import workload_range  # noqa: E402

PROG = "grpo_hf"
WORKLOAD = "grpo-hf-step"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Relative spacing of representable numbers (one ulp at most, relative to the value): bf16 keeps 7 fraction bits.
ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -23}
INSTALL_HINT = "pip install 'rlkernel[hf]' (or: pip install transformers)"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__.split("\n")[0],
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="auto: cuda when available")
    p.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                   help="model dtype; auto: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--hidden-size", type=int, default=896, help="Qwen2 hidden size (H)")
    p.add_argument("--intermediate-size", type=int, default=4864, help="MLP width")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--heads", type=int, default=14, help="attention heads (must divide --hidden-size)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (must divide --heads)")
    p.add_argument("--vocab-size", type=int, default=151936, help="vocabulary (V)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--samples", type=int, default=8, help="completions per prompt (the GRPO group)")
    p.add_argument("--prompt-len", type=int, default=64, help="random prompt tokens")
    p.add_argument("--new-tokens", type=int, default=256, help="sampled tokens per completion")
    p.add_argument("--steps", type=int, default=3, help="GRPO steps (one rollout, one update each)")
    p.add_argument("--temperature", type=float, default=0.9, help="sampling and log-prob temperature")
    p.add_argument("--entropy-coef", type=float, default=0.01, help="weight of the entropy bonus")
    p.add_argument("--clip-eps", type=float, default=0.2, help="ratio clip: [1 - eps, 1 + eps]")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate")
    p.add_argument("--chunk-size", type=int, default=None, help="tokens per linear_logp_loss chunk (default: its own)")
    p.add_argument("--backend", choices=("auto", "fused", "native"), default="auto",
                   help="backend of rlkernel.linear_logp_loss")
    p.add_argument("--require-fused", action="store_true",
                   help="exit 3 before training if the fused linear_logp_loss cannot run here; exit 1 if a step's "
                        "call did not run fused")
    p.add_argument("--manifest", type=Path, default=None,
                   help="write a run manifest (docs/contracts.md section 6) naming the grpo-hf-step workload here")
    p.add_argument("--seed", type=int, default=0, help="weights, prompts and sampling")
    return p


def _check_args(args) -> None:
    for name in ("hidden_size", "intermediate_size", "layers", "heads", "kv_heads", "prompts", "prompt_len",
                 "new_tokens", "steps"):
        if getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}", EXIT_USAGE)
    if args.samples < 2:
        raise CliError(f"--samples must be >= 2 (GRPO normalises within a group), got {args.samples}", EXIT_USAGE)
    if args.vocab_size < 2:
        raise CliError(f"--vocab-size must be >= 2, got {args.vocab_size}", EXIT_USAGE)
    if args.hidden_size % args.heads or args.heads % args.kv_heads:
        raise CliError("--heads must divide --hidden-size and --kv-heads must divide --heads", EXIT_USAGE)
    if not args.temperature > 0:
        raise CliError(f"--temperature must be > 0, got {args.temperature}", EXIT_USAGE)
    if args.chunk_size is not None and args.chunk_size < 1:
        raise CliError(f"--chunk-size must be >= 1, got {args.chunk_size}", EXIT_USAGE)
    if args.require_fused and args.backend == "native":
        raise CliError("--require-fused contradicts --backend native", EXIT_USAGE)


def load_transformers():
    """The optional dependency, imported only here."""
    try:
        import transformers
    except ImportError as exc:
        raise CliError(f"transformers is not installed ({exc}): {INSTALL_HINT}", EXIT_BLOCKED) from None
    return transformers


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise CliError(f"--device cuda: CUDA is not available (torch {torch.__version__})", EXIT_BLOCKED)
    return torch.device(name)


def make_model(tf, args, device, dtype):
    cfg = tf.Qwen2Config(hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, vocab_size=args.vocab_size,
                         max_position_embeddings=args.prompt_len + args.new_tokens, tie_word_embeddings=False)
    torch.manual_seed(args.seed)
    return tf.Qwen2ForCausalLM(cfg).to(device=device, dtype=dtype)


@torch.no_grad()
def rollout(model, args, gen, device):
    """(input ids [B, P + T], completions [B, T]): prompts repeated --samples times, T tokens sampled with a KV
    cache through rlkernel.sample at --temperature."""
    prompts = torch.randint(1, args.vocab_size, (args.prompts, args.prompt_len), generator=gen, device=device)
    ids = prompts.repeat_interleave(args.samples, dim=0)
    # transformers 5 names the KV cache `cache`; 4.x `past_key_values`
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    toks = []
    for i in range(args.new_tokens):
        tok = rlkernel.sample(out.logits[:, -1].float(), temperature=args.temperature, generator=gen)
        toks.append(tok)
        if i + 1 < args.new_tokens:
            out = model(input_ids=tok[:, None], use_cache=True, logits_to_keep=1, **{key: out[key]})
    comp = torch.stack(toks, dim=1)
    return torch.cat([ids, comp], dim=1), comp, prompts.repeat_interleave(args.samples, dim=0)


def token_loss(lp, ent, old, adv, eps, coef):
    """Per-token GRPO objective: the PPO-clipped ratio against the rollout policy, minus the entropy bonus."""
    ratio = torch.exp(lp - old)
    return -torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv) - coef * ent


def loss_bound(max_z, s, hidden, vocab, t, dtype, mean_abs_adv, eps, coef, loss) -> float:
    """How far the two paths' losses may be apart, from the one place they differ: the logits' GEMM.

    Both paths read the same hidden states (model(ids) runs model.model(ids), then lm_head) and compute the same
    float32 log-softmax; their GEMMs may sum the H products of a logit in another order. In float32 the two sums
    differ by at most H * 2^-24 * sum_k |h_k w_k| <= H * 2^-24 * s (s = max |h| * max |w| over rows, Cauchy-Schwarz),
    and after rounding to the model's dtype by at most one more ulp, ULP * max|z|. So every logit / T moves by at
    most delta. A token's logp moves by at most 2 delta (the l1 norm of onehot - p is <= 2) and its entropy by at
    most 2 log(V) delta (sum_j p_j |log p_j + H| <= 2H <= 2 log V); the clipped objective's slope in logp is at most
    (1 + eps) |A|, the bonus's coef. The mean loss moves by at most delta (2 (1 + eps) mean|A| + 2 coef log V);
    doubled for the second-order terms, plus 1e-5 (1 + |loss|) for float32 arithmetic in the two softmaxes.
    """
    delta = (ULP[dtype] * max_z + hidden * 2.0 ** -24 * s) / t
    return 2 * delta * (2 * (1 + eps) * mean_abs_adv + 2 * coef * math.log(vocab)) + 1e-5 * (1 + abs(loss))


def _peak_start(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    return 0


def _peak(device, base):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    return None


def reference_step(model, ids, comp, keep, adv_tok, args):
    """The model's own path: full logits, float32 log_softmax, gather, entropy; loss.backward(). Returns the loss,
    the rollout log-probs it used as the old policy, and the numbers loss_bound reads."""
    p = args.prompt_len
    logits = model(input_ids=ids).logits[:, p - 1:-1]
    x = logits.float() / args.temperature
    la = torch.log_softmax(x, dim=-1)
    lp = la.gather(-1, torch.where(keep, comp, 0)[..., None]).squeeze(-1)
    ent = -(la.exp() * la).sum(-1)
    old = lp.detach()  # one update per rollout: the rollout policy is the current one
    per = token_loss(lp, ent, old, adv_tok, args.clip_eps, args.entropy_coef)
    loss = torch.where(keep, per, 0.0).sum() / keep.sum().clamp_min(1)
    loss.backward()
    return loss.detach(), old, logits.detach().abs().max().item()


def rlkernel_step(model, ids, comp, keep, adv_tok, old, args):
    """rlkernel.linear_logp_loss on the last hidden states and lm_head.weight: no N x V logits."""
    p = args.prompt_len
    hidden = model.model(input_ids=ids).last_hidden_state[:, p - 1:-1]
    targets = torch.where(keep, comp, IGNORE)
    old_flat, adv_flat = old.reshape(-1), adv_tok.reshape(-1)

    def loss_fn(lp, ent, sl):
        return token_loss(lp, ent, old_flat[sl], adv_flat[sl], args.clip_eps, args.entropy_coef)

    with dispatch.recording() as rec:
        loss = rlkernel.linear_logp_loss(hidden, model.lm_head.weight, targets, loss_fn,
                                         temperature=args.temperature, reduction="mean",
                                         chunk_size=args.chunk_size, backend=args.backend,
                                         require_fused=args.require_fused)
        loss.backward()
    w = model.lm_head.weight.detach()
    s = hidden.detach().float().norm(dim=-1).max().item() * w.float().norm(dim=-1).max().item()
    return loss.detach(), rec.statuses("linear_logp_loss"), s


def write_manifest(path: Path, args, dtype) -> None:
    n = args.prompts * args.samples * args.new_tokens
    flops = 3 * 2 * n * args.hidden_size * args.vocab_size  # the LM head's three GEMMs
    shape = {"batch_size": args.prompts * args.samples, "seq_len": args.new_tokens, "vocab_size": args.vocab_size,
             "temperature": args.temperature}
    data = {"schema": 1, "status": "complete", "error": None, "command": [PROG, *sys.argv[1:]],
            "workloads": [{"name": WORKLOAD, "op": "grpo-step", "path": "fused", "shape": shape,
                           "dtype": str(dtype).removeprefix("torch."), "warmup": 0, "repeat": args.steps,
                           "bytes": 0, "flops": flops, "fused_patterns": ["rlkernel_*"],
                           "fused_ops": ["linear_logp_loss"]}],
            "dispatch": dispatch.history_json(), "node": {}, "tools": {}, "steps": [], "env": {}}
    path.write_text(json.dumps(data, indent=1))


def train(args) -> int:
    tf = load_transformers()
    device = _device(args.device)
    dtype = DTYPES[args.dtype] if args.dtype != "auto" else (torch.bfloat16 if device.type == "cuda"
                                                             else torch.float32)
    if args.require_fused:
        reason = dispatch.fused_unavailable_reason("linear_logp_loss", device, dtype)
        if reason:
            raise CliError(f"--require-fused: fused linear_logp_loss cannot run: {reason}", EXIT_BLOCKED)
    model = make_model(tf, args, device, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    n_tok = args.prompts * args.samples * args.new_tokens
    logits_bytes = n_tok * args.vocab_size * torch.finfo(dtype).bits // 8
    failed = []
    for step in range(1, args.steps + 1):
        model.eval()  # no dropout: both paths see one function
        ids, comp, prompts = rollout(model, args, gen, device)
        keep = completion_mask(comp)
        adv = group_advantages(synthetic_reward(prompts, comp, keep), args.samples)
        adv_tok = adv[:, None].expand_as(comp).to(torch.float32)

        opt.zero_grad(set_to_none=True)
        base = _peak_start(device)
        ref_loss, old, max_z = reference_step(model, ids, comp, keep, adv_tok, args)
        ref_peak = _peak(device, base)
        ref_grad = model.lm_head.weight.grad.detach().float().clone()

        opt.zero_grad(set_to_none=True)
        base = _peak_start(device)
        with workload_range(WORKLOAD), torch.autograd.set_multithreading_enabled(False):
            rk_loss, statuses, s = rlkernel_step(model, ids, comp, keep, adv_tok, old, args)
            opt.step()
        rk_peak = _peak(device, base)
        rlkernel.check_errors(device)

        g = model.lm_head.weight.grad.detach().float()
        grad_rel = ((g - ref_grad).norm() / ref_grad.norm().clamp_min(1e-30)).item()
        mean_abs_adv = adv_tok[keep].abs().mean().item() if keep.any() else 0.0
        bound = loss_bound(max_z, s, args.hidden_size, args.vocab_size, args.temperature, dtype, mean_abs_adv,
                           args.clip_eps, args.entropy_coef, ref_loss.item())
        diff = abs(rk_loss.item() - ref_loss.item())
        line = (f"step {step}/{args.steps}  loss[model logits] {ref_loss.item():.7f}  loss[linear_logp_loss "
                f"{'/'.join(sorted(statuses))}] {rk_loss.item():.7f}  |diff| {diff:.3g}  bound {bound:.3g} "
                f"{'ok' if diff <= bound else 'EXCEEDED'}  lm_head grad rel diff {grad_rel:.3g}")
        if diff > bound:
            failed.append(f"step {step}: loss difference {diff:.3g} beyond the bound {bound:.3g}")
        if ref_peak is not None:
            drop = ref_peak - rk_peak
            ok = drop >= logits_bytes
            line += (f"  peak GiB {ref_peak / 2 ** 30:.2f} -> {rk_peak / 2 ** 30:.2f} (drop {drop / 2 ** 30:.2f}, "
                     f"logits {logits_bytes / 2 ** 30:.2f}: {'ok' if ok else 'TOO SMALL'})")
            if not ok:
                failed.append(f"step {step}: peak memory dropped by {drop} bytes, less than the logits' "
                              f"{logits_bytes}")
        else:
            line += "  peak memory: not measured on cpu"
        print(line, flush=True)
        if args.require_fused and statuses != {"fused"}:
            failed.append(f"step {step}: linear_logp_loss ran {'/'.join(sorted(statuses))}, not fused")
    if args.manifest is not None:
        write_manifest(args.manifest, args, dtype)
    if failed:
        raise CliError("; ".join(failed), EXIT_CHECK_FAILED)
    return EXIT_OK


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        check_env_flags()  # a bad RLKERNEL_* value: one line, exit 2, before any step
        _check_args(args)
        warnings.simplefilter("ignore", FallbackWarning)  # every step line prints the path that ran
        return train(args)
    except FusedKernelUnavailable as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_BLOCKED
    except CliError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return exc.code


if __name__ == "__main__":
    sys.exit(main())
