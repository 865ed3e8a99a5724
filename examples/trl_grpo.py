"""TRL's GRPOTrainer on a random-weight tiny Qwen2 with ``rlkernel.integrations.trl.apply()``, checked against the
unmodified run.

Nothing is downloaded: a word-level tokenizer (``tokenizers``) and a Qwen2 built from a config are saved to a
temporary folder (GRPOTrainer loads its reference model from the policy's path when beta > 0). The same GRPO run
(--steps steps, beta > 0, an entropy bonus, prompts of different lengths so TRL left-pads them, completions that
stop at EOS so it right-pads those) is trained twice from one seed: with TRL's own fused LM head, then inside
``rlkernel.integrations.trl.apply()``. Per step the two losses must agree within --loss-rtol (relative) and the
gradients TRL hands the optimizer within --grad-rtol (relative norm, per parameter). The rlkernel run's
dispatch history is printed: ``linear_logp.forward`` / ``linear_logp.backward`` (``fused`` on a GPU with the
extension built; ``fallback`` "tensor on cpu" on CPU, rlkernel's native path), and any ``integrations.trl``
fallback with its reason (``--bf16`` on a float32 model: TRL's bf16 autocast head is mixed precision, which goes
back to TRL).

Exit codes (docs/contracts.md, section 5): 0 the runs agree; 1 a check failed (a loss or gradient beyond its
tolerance, no rlkernel call, or under --require-fused a linear_logp call that did not run fused); 2 bad usage; 3
trl / transformers / datasets missing or an unsupported trl, no CUDA with --device cuda.
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
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

PROG = "trl_grpo"
INSTALL_HINT = "pip install trl==1.16.0 (it brings transformers, accelerate and datasets)"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SPECIAL = ("<pad>", "<eos>")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__.split("\n")[0],
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="auto: cuda when available")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="the model's weights")
    p.add_argument("--bf16", action="store_true", help="TRL's bf16 autocast (GRPOConfig bf16=True)")
    p.add_argument("--steps", type=int, default=3, help="GRPO steps")
    p.add_argument("--words", type=int, default=62, help="tokenizer words besides <pad> and <eos> (V = words + 2)")
    p.add_argument("--hidden-size", type=int, default=32, help="Qwen2 hidden size")
    p.add_argument("--layers", type=int, default=2, help="decoder layers")
    p.add_argument("--completion-len", type=int, default=8, help="max_completion_length")
    p.add_argument("--generations", type=int, default=4, help="num_generations (the GRPO group)")
    p.add_argument("--beta", type=float, default=0.1, help="KL coefficient (> 0: a reference model)")
    p.add_argument("--entropy-coef", type=float, default=0.01, help="entropy bonus")
    p.add_argument("--temperature", type=float, default=0.9, help="sampling and log-prob temperature")
    p.add_argument("--loss-rtol", type=float, default=None,
                   help="relative loss tolerance (default: 1e-5 for float32 weights, 2e-2 for bfloat16)")
    p.add_argument("--grad-rtol", type=float, default=None,
                   help="relative gradient-norm tolerance (default: 1e-4 for float32 weights, 5e-2 for bfloat16)")
    p.add_argument("--require-fused", action="store_true",
                   help="exit 1 unless every linear_logp call of the rlkernel run ran fused")
    p.add_argument("--seed", type=int, default=0, help="weights, data and sampling")
    return p


def _check_args(args) -> None:
    for name in ("steps", "words", "hidden_size", "layers", "completion_len"):
        if getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}", EXIT_USAGE)
    if args.generations < 2:
        raise CliError(f"--generations must be >= 2, got {args.generations}", EXIT_USAGE)
    if args.hidden_size % 4:
        raise CliError(f"--hidden-size must be a multiple of 4 (4 attention heads), got {args.hidden_size}",
                       EXIT_USAGE)
    if not args.temperature > 0:
        raise CliError(f"--temperature must be > 0, got {args.temperature}", EXIT_USAGE)
    if args.beta < 0 or args.entropy_coef < 0:
        raise CliError("--beta and --entropy-coef must be >= 0", EXIT_USAGE)


def load_frameworks():
    """trl (and what it brings: transformers, datasets, tokenizers), imported only here; exit 3 when missing."""
    try:
        import datasets
        import tokenizers
        import transformers
        import trl
    except ImportError as exc:
        raise CliError(f"{exc.name or exc} is not installed: {INSTALL_HINT}", EXIT_BLOCKED) from None
    return datasets, tokenizers, transformers, trl


def save_tiny_model(folder: Path, args, dtype: torch.dtype) -> None:
    """A word-level tokenizer of --words words and a random Qwen2 over it, saved to ``folder``."""
    _, tokenizers, tf, _ = load_frameworks()
    vocab = {tok: i for i, tok in enumerate((*SPECIAL, *(f"w{i}" for i in range(args.words))))}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>").save_pretrained(folder)
    cfg = tf.Qwen2Config(vocab_size=len(vocab), hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=None,
                         tie_word_embeddings=False)
    torch.manual_seed(args.seed)
    tf.Qwen2ForCausalLM(cfg).to(dtype).save_pretrained(folder)


def prompts(args) -> list[str]:
    """Prompts of 1 to 4 words: TRL left-pads them to one length."""
    return [" ".join(f"w{(3 * i + j) % args.words}" for j in range(1 + i % 4)) for i in range(8)]


def reward(completions, **_) -> list[float]:
    """Longer completions score higher: a signal that does not depend on the tokens' meaning."""
    return [float(len(c)) for c in completions]


def train(folder: Path, args, device: torch.device, dtype: torch.dtype) -> tuple[list[float], list[dict], dict]:
    """One GRPO run from the saved model: per-step losses, per-step gradients (as TRL hands them to the optimizer,
    upcast to float32), and the completion-length metrics (to show the right padding happened)."""
    datasets, _, tf, trl = load_frameworks()

    class Grads(tf.TrainerCallback):
        def __init__(self):
            self.steps = []

        def on_pre_optimizer_step(self, _args, _state, _control, model=None, **_):
            self.steps.append({n: p.grad.detach().float().clone() for n, p in model.named_parameters()
                               if p.grad is not None})

    config = trl.GRPOConfig(
        output_dir=str(folder / "out"), max_steps=args.steps, per_device_train_batch_size=args.generations,
        num_generations=args.generations, max_completion_length=args.completion_len, beta=args.beta,
        entropy_coef=args.entropy_coef, temperature=args.temperature, logging_steps=1, report_to="none",
        save_strategy="no", seed=args.seed, bf16=args.bf16, use_cpu=device.type == "cpu", disable_tqdm=True,
        model_init_kwargs={"dtype": dtype})
    grads = Grads()
    trainer = trl.GRPOTrainer(model=str(folder), reward_funcs=reward, args=config,
                              train_dataset=datasets.Dataset.from_dict({"prompt": prompts(args)}),
                              processing_class=tf.PreTrainedTokenizerFast.from_pretrained(folder), callbacks=[grads])
    for quiet in (tf.PrinterCallback, tf.ProgressCallback):  # the step lines of compare() say what matters
        trainer.remove_callback(quiet)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    lengths = {k: [h[k] for h in logs] for k in ("completions/min_length", "completions/max_length")}
    return [h["loss"] for h in logs], grads.steps, lengths


def grad_rel(a: dict, b: dict) -> float:
    """The largest relative norm difference over the parameters."""
    return max(((a[n] - b[n]).norm() / a[n].norm().clamp_min(1e-30)).item() for n in a)


def compare(ref, got, args, dtype) -> list[str]:
    loss_rtol = args.loss_rtol if args.loss_rtol is not None else (1e-5 if dtype == torch.float32 else 2e-2)
    grad_rtol = args.grad_rtol if args.grad_rtol is not None else (1e-4 if dtype == torch.float32 else 5e-2)
    (ref_losses, ref_grads, _), (losses, grads, _) = ref, got
    failed = []
    if len(losses) != len(ref_losses) or len(grads) != len(ref_grads):
        return [f"the runs logged {len(ref_losses)} and {len(losses)} losses"]
    for step, (a, b) in enumerate(zip(ref_losses, losses, strict=True), 1):
        rel = abs(a - b) / max(abs(a), 1e-30)
        g = grad_rel(ref_grads[step - 1], grads[step - 1])
        ok = math.isfinite(b) and rel <= loss_rtol and g <= grad_rtol
        print(f"step {step}/{len(losses)}  loss[trl] {a:.9g}  loss[rlkernel] {b:.9g}  rel {rel:.3g} "
              f"(tol {loss_rtol:g})  grad rel-norm {g:.3g} (tol {grad_rtol:g})  {'ok' if ok else 'MISMATCH'}",
              flush=True)
        if not ok:
            failed.append(f"step {step}: loss rel {rel:.3g}, gradient rel-norm {g:.3g}")
    return failed


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise CliError(f"--device cuda: CUDA is not available (torch {torch.__version__})", EXIT_BLOCKED)
    return torch.device(name)


def run(args) -> int:
    _, _, tf, _ = load_frameworks()
    tf.utils.logging.set_verbosity_error()
    tf.utils.logging.disable_progress_bar()
    from rlkernel.integrations import UnsupportedVersionError
    from rlkernel.integrations import trl as rk_trl

    device = _device(args.device)
    dtype = DTYPES[args.dtype]
    with tempfile.TemporaryDirectory(prefix="trl_grpo-") as tmp:
        folder = Path(tmp)
        save_tiny_model(folder, args, dtype)
        ref = train(folder, args, device, dtype)
        try:
            patch = rk_trl.apply()
        except UnsupportedVersionError as exc:
            raise CliError(str(exc), EXIT_BLOCKED) from None
        with patch, dispatch.recording() as rec:
            got = train(folder, args, device, dtype)
    failed = compare(ref, got, args, dtype)
    print("rlkernel run dispatch:")
    for r, n in sorted(rec.records):
        print(f"  {r.op:22s} {r.status:8s} {r.backend:9s} x{n}  {r.reason}")
    lp = {r.status for r, _ in rec.records if r.op.startswith("linear_logp")}
    if not lp and not any(r.op == rk_trl.OP for r, _ in rec.records):
        failed.append("neither a linear_logp call nor a recorded fallback in the rlkernel run: the patch never ran")
    if args.require_fused and lp != {"fused"}:
        failed.append(f"linear_logp ran {'/'.join(sorted(lp)) or 'never'}, not fused")
    if failed:
        raise CliError("; ".join(failed), EXIT_CHECK_FAILED)
    return EXIT_OK


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        _check_args(args)
        check_env_flags()  # a bad RLKERNEL_* value: one line, exit 2, before any step
        warnings.simplefilter("ignore", FallbackWarning)  # the dispatch lines say what ran
        warnings.simplefilter("ignore", FutureWarning)  # the frameworks' deprecation notices
        return run(args)
    except FusedKernelUnavailable as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_BLOCKED
    except CliError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return exc.code


if __name__ == "__main__":
    sys.exit(main())
