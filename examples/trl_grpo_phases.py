"""A tiny TRL GRPOTrainer run whose RL phases are NVTX ranges (rlkernel.phase / rlkernel.step, contract 3).

A random-weight Qwen2 (2 layers, width 32) built from a config and a character-level tokenizer built here: nothing
is downloaded. ``rlkernel.integrations.trl.apply(head=False, phases=True)`` marks them where TRL runs them (its
GRPOTrainer methods replaced on the class, a TrainerCallback for the steps; TRL's own LM head is kept):

  step               TrainerCallback.on_step_begin / on_step_end (index: state.global_step at the step's start)
  rollout            GRPOTrainer._generate (generation)
  old_logprob        GRPOTrainer._get_per_token_logps_and_entropies of the policy without grad (num_iterations > 1)
  reference_logprob  the same for the reference model (beta > 0)
  policy_forward     the same with grad: the training forward, inside loss
  loss               GRPOTrainer.compute_loss
  backward           Accelerator.backward
  optimizer          TrainerCallback.on_pre_optimizer_step / on_optimizer_step
  weight_sync        the vLLM weight sync, where TRL uses vLLM

Under a profiler the ranges are in the trace; without one a range costs one attribute test. Profile it with:

    python -m pipelines.capture -- python examples/trl_grpo_phases.py --max-steps 2
    python -m pipelines.capture --steps 1:2 -- python examples/trl_grpo_phases.py --max-steps 4

Runs on the CPU in seconds and on one GPU (trl 1.16, transformers 5, datasets). Exit codes: 0 done, 2 bad usage,
3 this machine lacks TRL/transformers/datasets or a CUDA device asked for.
"""
from __future__ import annotations

import argparse
import os
import shutil
import string
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: this tree's rlkernel first

import rlkernel  # noqa: E402
from rlkernel.cli import EXIT_BLOCKED, EXIT_OK, CliError, OneLineParser, check_env_flags  # noqa: E402

PROG = "trl_grpo_phases"
PROMPTS = ["abc", "hello", "grpo", "xyz", "phase", "step", "tiny", "rl"]


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog=PROG, description=__doc__.splitlines()[0],
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--max-steps", type=int, default=2, help="training steps (TRL's max_steps)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--num-generations", type=int, default=4, help="completions per prompt (the GRPO group)")
    ap.add_argument("--max-completion-length", type=int, default=8)
    ap.add_argument("--num-iterations", type=int, default=2,
                    help="policy updates per generation batch (> 1: TRL computes the old log-probs)")
    ap.add_argument("--beta", type=float, default=0.04, help="KL weight (> 0: a reference model and its log-probs)")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def check_args(args) -> None:
    for flag in ("max_steps", "num_generations", "max_completion_length", "num_iterations"):
        if getattr(args, flag) < 1:
            raise CliError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not args.beta >= 0:
        raise CliError(f"--beta must be >= 0, got {args.beta}")


def imports():
    """TRL and what it needs, or exit 3 saying how to get them."""
    try:
        import datasets
        import tokenizers
        import torch
        import transformers
        import trl
    except ImportError as e:
        raise CliError(f"{e.name} is missing: pip install trl==1.16.0 datasets", EXIT_BLOCKED) from None
    return torch, tokenizers, transformers, datasets, trl


def tiny_model(folder: Path, seed: int, mods) -> None:
    """A character-level tokenizer and a random-weight Qwen2 saved in ``folder`` (TRL loads the policy and the
    reference model from a path)."""
    torch, tokenizers, transformers, _, _ = mods
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(string.ascii_lowercase + " ")}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")  # one token per character
    tok.decoder = tokenizers.decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>")
    config = transformers.Qwen2Config(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=1,
                                      tie_word_embeddings=True)
    torch.manual_seed(seed)
    transformers.Qwen2ForCausalLM(config).save_pretrained(folder)
    fast.save_pretrained(folder)


def reward(completions, **kwargs) -> list[float]:
    """Distinct characters per completion: a reward with spread, so the advantages are not all zero."""
    return [float(len(set(c))) for c in completions]


def train(args, mods) -> int:
    torch, _, transformers, datasets, trl = mods
    transformers.utils.logging.disable_progress_bar()  # the tiny model's save/load bars say nothing here
    datasets.disable_progress_bars()
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise CliError(f"--device cuda: CUDA is not available (torch {torch.__version__})", EXIT_BLOCKED)
    work = Path(tempfile.mkdtemp(prefix="trl_grpo_phases-"))
    try:
        tiny_model(work / "model", args.seed, mods)
        config = trl.GRPOConfig(
            output_dir=str(work / "out"), max_steps=args.max_steps, per_device_train_batch_size=args.num_generations,
            num_generations=args.num_generations, max_completion_length=args.max_completion_length,
            num_iterations=args.num_iterations, beta=args.beta, learning_rate=1e-3, seed=args.seed,
            use_cpu=device == "cpu", bf16=False, report_to="none", logging_strategy="no", save_strategy="no",
            disable_tqdm=True, dataloader_num_workers=0)
        dataset = datasets.Dataset.from_dict({"prompt": PROMPTS})
        trainer = trl.GRPOTrainer(model=str(work / "model"), reward_funcs=reward, args=config,
                                  train_dataset=dataset, processing_class=trl_tokenizer(work / "model", mods))
        try:
            phases = rlkernel.integrations.trl.apply(head=False, phases=True)
        except rlkernel.integrations.UnsupportedVersionError as e:
            raise CliError(f"{e} (pip install trl==1.16.0)", EXIT_BLOCKED) from None
        t0 = time.perf_counter()
        with phases:
            trainer.train()
        print(f"{PROG}: {args.max_steps} GRPO step(s) on {device} in {time.perf_counter() - t0:.2f} s "
              f"(TRL {trl.__version__})", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return EXIT_OK


def trl_tokenizer(folder: Path, mods):
    return mods[2].AutoTokenizer.from_pretrained(folder)


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        check_env_flags()
        check_args(args)
        mods = imports()
        warnings.simplefilter("ignore", FutureWarning)  # transformers' deprecation notes about TRL's own calls
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        return train(args, mods)
    except CliError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return e.code


if __name__ == "__main__":
    sys.exit(main())
