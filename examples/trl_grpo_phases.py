"""A tiny TRL GRPOTrainer run whose RL phases are NVTX ranges (rlkernel.phase / rlkernel.step, contract 3).

A random-weight Qwen2 built from a config and a character-level tokenizer built here: nothing is downloaded.
``--shape tiny`` (default): 2 layers, width 32, 30 tokens, float32. ``--shape qwen2.5-0.5b``: Qwen2.5-0.5B's shape
(24 layers, width 896, intermediate 4864, 14 heads, 2 kv heads, 151936 tokens, tied embeddings), bf16 on CUDA;
its vocabulary is the characters plus synthetic tokens, so every id a random model samples decodes.
``rlkernel.integrations.trl.apply(head=..., phases=True)`` marks the phases where TRL runs them (its GRPOTrainer
methods replaced on the class, a TrainerCallback for the steps); ``--head trl`` (default) keeps TRL's own LM head,
``--head rlkernel`` routes it through ``rlkernel.linear_logp`` too:

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
    python -m pipelines.capture -- python examples/trl_grpo_phases.py --shape qwen2.5-0.5b --head rlkernel

(the last one is tools/rl_step_walkthrough.sh's capture, on one GPU).

The tiny shape runs on the CPU in seconds; both run on one GPU (trl 1.16, transformers 5, datasets). Exit codes:
0 done, 2 bad usage, 3 this machine lacks TRL/transformers/datasets or a CUDA device asked for.
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
SPECIALS = ("<pad>", "<eos>", "<unk>")
CHARS = string.ascii_lowercase + " "
# Qwen2Config fields per shape; vocab_size is the tokenizer's (tiny: the specials and characters alone).
SHAPES = {
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=128),
    # Qwen/Qwen2.5-0.5B's config.json, less its weights
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                         rope_theta=1000000.0, rms_norm_eps=1e-6),
}


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog=PROG, description=__doc__.splitlines()[0],
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--max-steps", type=int, default=2, help="training steps (TRL's max_steps)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--shape", choices=tuple(SHAPES), default="tiny",
                    help="the random model's shape (qwen2.5-0.5b: bf16 on CUDA, float32 on the CPU)")
    ap.add_argument("--head", choices=("trl", "rlkernel"), default="trl",
                    help="the LM head's log-probs: TRL's own, or rlkernel.linear_logp (apply(head=True))")
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


def vocabulary(size: int | None) -> dict[str, int]:
    """Specials, then one token per character, then synthetic tokens ``t<id>`` up to ``size`` entries: prompts
    encode character by character, and any id a random model samples decodes to text."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + tuple(CHARS))}
    for i in range(len(vocab), size or 0):
        vocab[f"t{i}"] = i
    return vocab


def random_model(folder: Path, shape: str, dtype, device: str, seed: int, mods) -> None:
    """A character-level tokenizer and a random-weight Qwen2 of ``shape`` saved in ``folder`` in ``dtype`` (TRL
    loads the policy and the reference model from a path). Initialised on ``device``: 0.5B parameters initialise
    in a second on a GPU, in tens of seconds on a CPU."""
    torch, _, transformers, _, _ = mods
    fast, config = tokenizer_and_config(shape, mods)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.Qwen2ForCausalLM(config)
    model.to(dtype).save_pretrained(folder)
    fast.save_pretrained(folder)


def tokenizer_and_config(shape: str, mods):
    """The tokenizer (one token per character, ``vocabulary``) and the Qwen2Config of ``shape``."""
    _, tokenizers, transformers, _, _ = mods
    fields = dict(SHAPES[shape])
    vocab = vocabulary(fields.pop("vocab_size", None))
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")  # one token per character
    tok.decoder = tokenizers.decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>")
    config = transformers.Qwen2Config(vocab_size=len(vocab), pad_token_id=0, bos_token_id=1, eos_token_id=1,
                                      tie_word_embeddings=True, **fields)
    return fast, config


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
    bf16 = args.shape != "tiny" and device == "cuda"
    dtype = torch.bfloat16 if bf16 else torch.float32
    work = Path(tempfile.mkdtemp(prefix="trl_grpo_phases-"))
    try:
        random_model(work / "model", args.shape, dtype, device, args.seed, mods)
        config = trl.GRPOConfig(
            output_dir=str(work / "out"), max_steps=args.max_steps, per_device_train_batch_size=args.num_generations,
            num_generations=args.num_generations, max_completion_length=args.max_completion_length,
            num_iterations=args.num_iterations, beta=args.beta, learning_rate=1e-3, seed=args.seed,
            use_cpu=device == "cpu", bf16=bf16, report_to="none", logging_strategy="no", save_strategy="no",
            disable_tqdm=True, dataloader_num_workers=0,
            # TRL loads a model from a path in float32 unless told (the reference model too)
            model_init_kwargs={"dtype": "bfloat16" if bf16 else "float32"})
        dataset = datasets.Dataset.from_dict({"prompt": PROMPTS})
        trainer = trl.GRPOTrainer(model=str(work / "model"), reward_funcs=reward, args=config,
                                  train_dataset=dataset, processing_class=trl_tokenizer(work / "model", mods))
        try:
            phases = rlkernel.integrations.trl.apply(head=args.head == "rlkernel", phases=True)
        except rlkernel.integrations.UnsupportedVersionError as e:
            raise CliError(f"{e} (pip install trl==1.16.0)", EXIT_BLOCKED) from None
        t0 = time.perf_counter()
        with phases:
            trainer.train()
        print(f"{PROG}: {args.max_steps} GRPO step(s) on {device} in {time.perf_counter() - t0:.2f} s "
              f"(shape {args.shape}, {str(dtype).removeprefix('torch.')}, {args.head} LM head, TRL {trl.__version__})",
              flush=True)
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
