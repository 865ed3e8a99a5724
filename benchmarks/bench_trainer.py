"""GRPO training in TRL, side by side (issue 33): the LM head + loss at kernel level, and GRPOTrainer end to end,
unmodified vs ``rlkernel.integrations.trl.apply()`` vs ``apply(loss=True)``.

    python benchmarks/bench_trainer.py --out bench_trainer.json            # both parts, about 4 min on an H200
    python benchmarks/bench_trainer.py --parts kernel --shapes 896x151936 --ns 16384 --methods trl,apply-loss
    python benchmarks/bench_trainer.py --parts e2e --e2e-steps 3

Kernel level (``--parts kernel``), per (H, V) in --shapes and N = B x T tokens in --ns (T = --seq-len), bf16
hidden states and weight (both requiring grad), forward + backward of one GRPO loss (loss_type ``grpo``, the
clipped objective with old log-probs off by up to 0.3 nats, beta 0, no entropy bonus: the objective every method
computes) at --temperature:
- ``trl``: TRL's fused head ``trl.kernels.ChunkedLogProbFunction`` (log-probs and entropy, as GRPOTrainer asks it)
  and TRL's loss in torch (rlkernel.integrations.trl_loss.per_token_losses: the formula of GRPOTrainer._compute_loss,
  tests/test_integration_trl_loss.py checks it equal), then backward;
- ``apply``: the same with the head by ``apply()`` (``rlkernel.linear_logp``);
- ``apply-loss``: ``apply(loss=True)``'s head call, the loss and its gradients in one ``rlkernel.linear_logp_loss``;
- ``liger``: Liger-Kernel's ``LigerFusedLinearGRPOLoss`` (loss_type grpo, beta 0, its defaults otherwise: chunks of
  one sequence, torch.compile unless --liger-eager; skipped with the reason where liger_kernel is not importable).
Median of --repeat runs after --warmup, each timed by its own pair of CUDA events (``ms``), and the median host
wall time of one call up to its synchronize (``wall ms``); peak memory: the allocator's peak during one run beyond
the inputs (benchmarks/_timing.py), the returned gradients included; ``loss`` the value (every method the same
objective); ``x trl`` the time over ``trl``'s at the same shape (target for apply-loss: >= 1.3x faster).

End to end (``--parts e2e``): GRPOTrainer over a random Qwen2.5-0.5B-shaped model (24 layers, H 896, MLP 4864, 14
heads, 2 KV heads, V 151936, bf16 weights, bf16=True), a word-level tokenizer over the whole vocabulary (nothing
downloaded), --e2e-batch completions per step of --e2e-completion-len tokens (random weights rarely stop early),
generation by transformers (no vLLM). Per variant (``trl``, ``apply``, ``apply-loss``): the step time (median wall
time of the optimizer steps after the first, synchronized), the run's peak memory, and the training part alone:
``compute_loss`` + backward on one micro-batch the run generated, median of --repeat runs (CUDA events), with its
share of the step, and the rlkernel dispatch records of that part (which path ran, and why).
RLKERNEL_VALIDATE=0 while timing. Prints markdown tables; --out writes them as JSON. Exit codes:
0 done, 2 bad arguments, 3 no CUDA / trl missing.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from _timing import events_median, peak_extra  # noqa: E402 (beside this script: on sys.path when it runs)

from rlkernel import dispatch  # noqa: E402
from rlkernel.cli import EXIT_BLOCKED, EXIT_OK, CliError, OneLineParser  # noqa: E402

PROG = "bench_trainer"
PARTS = ("kernel", "e2e")
METHODS = ("trl", "apply", "apply-loss", "liger")
VARIANTS = ("trl", "apply", "apply-loss")
SHAPES = "896x151936,3584x152064,4096x128256"
QWEN05 = dict(num_hidden_layers=24, hidden_size=896, intermediate_size=4864, num_attention_heads=14,
              num_key_value_heads=2, vocab_size=151936)


def build_parser():
    p = OneLineParser(prog=PROG, description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated, of kernel, e2e (default: %(default)s)")
    p.add_argument("--shapes", default=SHAPES, help="kernel level: comma-separated HxV (default: %(default)s)")
    p.add_argument("--ns", default="4096,16384", help="kernel level: comma-separated token counts N (default: "
                                                      "%(default)s)")
    p.add_argument("--seq-len", type=int, default=1024, help="kernel level: tokens per completion T (N = B x T)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"kernel level, of {', '.join(METHODS)}")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"end to end, of {', '.join(VARIANTS)}")
    p.add_argument("--temperature", type=float, default=0.9)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--e2e-steps", type=int, default=4, help="optimizer steps per variant (the first not timed)")
    p.add_argument("--e2e-batch", type=int, default=8, help="completions per step (one GRPO group)")
    p.add_argument("--e2e-completion-len", type=int, default=256, help="max_completion_length")
    p.add_argument("--liger-eager", action="store_true",
                   help="Liger without its torch.compile (default: compiled, as TRL built it; compiling takes the "
                        "warmup runs)")
    p.add_argument("--out", default=None, help="write the results as JSON to this file")
    return p


def _csv(text, known, what):
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in known]
    if bad or not items:
        raise CliError(f"--{what}: unknown {', '.join(bad) or 'empty list'} (known: {', '.join(known)})")
    return items


def _ints(text, what, sep=","):
    try:
        vals = [int(x) for x in text.split(sep)]
    except ValueError:
        raise CliError(f"--{what}: {text!r} is not a list of integers") from None
    if min(vals) < 1:
        raise CliError(f"--{what}: sizes must be >= 1")
    return vals


def _hv(text):
    parts = _ints(text.lower(), "shapes", sep="x")
    if len(parts) != 2:
        raise CliError(f"--shapes: {text!r} is not HxV (e.g. 896x151936)")
    return tuple(parts)


def wall_median(fn, prep, repeat: int) -> float:
    """Median host milliseconds of one ``fn()`` up to its synchronize (what a training loop waits for)."""
    times = []
    for _ in range(repeat):
        prep()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _pending(B, T, adv, old):
    """rlkernel.integrations.trl_loss's loss of GRPOTrainer with loss_type grpo, beta 0, no entropy bonus, every
    token scored (one accumulation step)."""
    from rlkernel.integrations import trl_loss

    mask = torch.ones(B, T, device="cuda")
    return trl_loss.Pending(
        labels=None, scored=torch.ones(B, T, dtype=torch.bool, device="cuda"), mask=mask, advantages=adv[:, None],
        old=old, ref=None, is_ratio=None, weight=mask / T / B, entropy_weight=None, loss_type="grpo",
        level="token", epsilon_low=0.2, epsilon_high=0.2, delta=None, beta=0.0, bias_correction_kl=False,
        entropy_coef=0.0)


def kernel_methods(B, T, H, V, temperature, liger_compiled=True):
    """{method: (fn returning the loss, prep) or a skip reason}; fn runs forward + backward."""
    from trl import kernels as trl_kernels

    from rlkernel.integrations import trl as rk_trl
    from rlkernel.integrations import trl_loss

    n = B * T
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = (torch.randn(n, H, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    weight = (torch.randn(V, H, device="cuda", generator=g) / H ** 0.5).bfloat16().requires_grad_()
    ids = torch.randint(0, V, (B, T), device="cuda", generator=g)
    with torch.no_grad():  # old log-probs near the policy's: ratios inside and outside the clip range
        lp0 = trl_kernels.ChunkedLogProbFunction.apply(hidden, weight, None, ids.view(-1), temperature, 32768, None,
                                                       1.0, ("log_probs",))[0]
    old = lp0.view(B, T).float() + 0.3 * (torch.rand(B, T, device="cuda", generator=g) - 0.5)
    adv = torch.randn(B, device="cuda", generator=g)
    outputs = ("log_probs", "entropy")

    def reset():
        hidden.grad = None
        weight.grad = None

    def head_then_loss(head):
        def run():
            p = _pending(B, T, adv, old)
            lp, ent = head.apply(hidden, weight, None, ids.view(-1), temperature, 32768, None, 1.0, outputs)[:2]
            loss = trl_loss.per_token_losses(p, lp.view(B, T), ent.view(B, T), slice(None)).sum()
            loss.backward()
            return loss.detach()
        return run, reset

    out = {"trl": head_then_loss(trl_kernels.ChunkedLogProbFunction),
           "apply": head_then_loss(rk_trl.RlkernelHead(trl_kernels.ChunkedLogProbFunction, "fused", True))}

    def fused_loss():
        p = _pending(B, T, adv, old)
        p.labels = ids
        p.logp = torch.zeros(B, T, device="cuda")
        p.entropy = torch.zeros_like(p.logp)
        trl_loss.fused_loss(p, hidden, weight, None, temperature, outputs,
                            dict(backend="fused", require_fused=True, logits_dtype=None))
        p.loss.backward()
        return p.loss.detach()

    out["apply-loss"] = (fused_loss, reset)
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except ImportError as exc:
        out["liger"] = f"liger_kernel not importable ({exc})"
        return out
    liger = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="grpo", temperature=temperature,
                                     epsilon_low=0.2, epsilon_high=0.2, compiled=liger_compiled)
    mask = torch.ones(B, T, device="cuda", dtype=torch.long)

    def run_liger():
        res = liger(hidden.view(B, T, H), weight, ids, mask, adv, old_per_token_logps=old)
        loss = res[0] if isinstance(res, tuple) else res
        loss.backward()
        return loss.detach()

    out["liger"] = (run_liger, reset)
    return out


def dw_accumulation(method, B, T, V) -> str:
    """How each method sums the weight gradient over tokens (the issue's targets compare at the same dtype), as the
    ops decide it (``rlkernel.ops.precision.accumulation_dtype`` with the default ``grad_accumulation="float32"``)."""
    from rlkernel.integrations import trl_loss
    from rlkernel.ops import precision
    from rlkernel.ops.fused import linear_logp as fused_linear

    if method not in ("apply", "apply-loss"):
        return {"trl": "float32 (TRL's backward)", "liger": "Liger's"}[method]
    rows = trl_loss.chunk_rows(B, T, V, 2) if method == "apply-loss" else fused_linear.MAX_BLOCK_ROWS
    parts, what = -(-B * T // rows), ("token chunks" if method == "apply-loss" else "row blocks")
    if precision.accumulation_dtype(torch.bfloat16, torch.bfloat16, "float32", parts) == torch.float32:
        return f"float32 over {parts} {what}"
    return f"one GEMM's float32 accumulator per vocabulary chunk, rounded once (1 of the {what})"


def run_kernel(args, shapes, ns, methods):
    rows = []
    for H, V in shapes:
        for n in ns:
            if n % args.seq_len:
                raise CliError(f"--ns: {n} is not a multiple of --seq-len {args.seq_len}")
            B, T = n // args.seq_len, args.seq_len
            fns = kernel_methods(B, T, H, V, args.temperature, not args.liger_eager)
            base = None
            for m in methods:
                row = dict(H=H, V=V, N=n, B=B, T=T, method=m)
                entry = fns[m]
                if isinstance(entry, str):
                    rows.append(dict(row, skipped=entry))
                    print(f"| {H}x{V} | {n} | {m} | skipped: {entry} |", flush=True)
                    continue
                fn, prep = entry
                try:
                    loss = float(fn())
                    ms = events_median(fn, prep, args.warmup, args.repeat)
                    wall = wall_median(fn, prep, max(3, args.repeat // 2))
                    peak = peak_extra(fn, prep)
                except torch.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    rows.append(dict(row, skipped="OOM"))
                    print(f"| {H}x{V} | {n} | {m} | OOM |", flush=True)
                    continue
                except Exception as exc:  # noqa: BLE001 - one method failing (a peer's API) must not hide the others
                    rows.append(dict(row, skipped=f"{type(exc).__name__}: {str(exc)[:160]}"))
                    print(f"| {H}x{V} | {n} | {m} | error {type(exc).__name__}: {str(exc)[:160]} |", flush=True)
                    continue
                base = ms if m == "trl" else base
                dw = dw_accumulation(m, B, T, V)
                row.update(ms=ms, wall_ms=wall, peak_gib=peak / 2 ** 30, loss=loss,
                           speedup_vs_trl=(base / ms) if base else None, dw_accumulation=dw)
                rows.append(row)
                x = f"{base / ms:.2f}x" if base else "-"
                print(f"| {H}x{V} | {n} | {m} | {ms:.2f} | {wall:.2f} | {peak / 2 ** 30:.2f} | {loss:.6g} | {x} | "
                      f"{dw} |", flush=True)
            del fns
            torch.cuda.empty_cache()
    return rows


def _save_model(folder: Path):
    import tokenizers
    import transformers as tf

    V = QWEN05["vocab_size"]
    vocab = {"<pad>": 0, "<eos>": 1} | {f"w{i}": i + 2 for i in range(V - 2)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>").save_pretrained(folder)
    cfg = tf.Qwen2Config(**QWEN05, max_position_embeddings=4096, pad_token_id=0, eos_token_id=1, bos_token_id=None,
                         tie_word_embeddings=True, rope_theta=1e6)
    torch.manual_seed(0)
    tf.Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)


def paths(records) -> str:
    """The dispatch records of a block in one cell: ``op status (reason) xN``, ``-`` where rlkernel ran nothing."""
    cells = [f"{r.op} {r.status}{f' ({r.reason})' if r.reason else ''} x{n}" for r, n in sorted(records)]
    return "; ".join(cells) or "-"


def run_variant(folder: Path, variant: str, args):
    import datasets
    import transformers as tf
    import trl

    from rlkernel.integrations import trl as rk_trl

    class StepTimes(tf.TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], None

        def on_step_begin(self, *_a, **_k):
            torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, *_a, **_k):
            torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.t0)

    prompts = [" ".join(f"w{(7 * i + j) % 1000}" for j in range(8 + i % 5)) for i in range(64)]
    config = trl.GRPOConfig(
        output_dir=str(folder / f"out-{variant}"), max_steps=args.e2e_steps, per_device_train_batch_size=args.e2e_batch,
        num_generations=args.e2e_batch, max_completion_length=args.e2e_completion_len, temperature=args.temperature,
        logging_steps=1, report_to="none", save_strategy="no", seed=0, bf16=True, disable_tqdm=True,
        model_init_kwargs={"dtype": torch.bfloat16})
    times = StepTimes()
    patch = None if variant == "trl" else rk_trl.apply(loss=variant == "apply-loss", phases=False)
    try:
        trainer = trl.GRPOTrainer(model=str(folder), reward_funcs=lambda completions, **_: [float(len(c)) for c in
                                                                                             completions],
                                  args=config, train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
                                  processing_class=tf.PreTrainedTokenizerFast.from_pretrained(folder),
                                  callbacks=[times])
        for quiet in (tf.PrinterCallback, tf.ProgressCallback):  # the tables say what matters
            trainer.remove_callback(quiet)
        torch.cuda.reset_peak_memory_stats()
        trainer.train()
        peak = torch.cuda.max_memory_allocated()
        model, inputs = trainer.model, trainer._buffered_inputs[0]
        trainer.current_gradient_accumulation_steps = 1

        def prep():
            model.zero_grad(set_to_none=True)

        def train_part():
            trainer.compute_loss(model, inputs).backward()

        # which path the training part's rlkernel calls took, and why. In an nsys trace the NVTX range names the
        # variant's training part, and the profiler range lets `nsys profile --capture-range=cudaProfilerApi
        # --capture-range-end=repeat` capture the training parts alone, one report each (no generation)
        with dispatch.recording() as rec:
            torch.cuda.profiler.start()
            try:
                with torch.cuda.nvtx.range(f"bench_trainer:train_part:{variant}"):
                    part = events_median(train_part, prep, 1, args.repeat)
            finally:
                torch.cuda.profiler.stop()
        part_peak = peak_extra(train_part, prep)
    finally:
        if patch is not None:
            patch.undo()
    timed = times.times[1:] or times.times
    step = statistics.median(timed) * 1e3
    row = dict(variant=variant, step_ms=step, steps_timed=len(timed), peak_gib=peak / 2 ** 30,
               train_part_ms=part, train_part_peak_gib=part_peak / 2 ** 30, train_share=part / step,
               tokens=int(inputs["completion_mask"].sum()), paths=paths(rec.records))
    return row  # the trainer and its model go with this frame, before the next variant builds its own


def run_e2e(args, variants):
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_trainer-") as tmp:
        folder = Path(tmp)
        _save_model(folder)
        for v in variants:
            row = run_variant(folder, v, args)
            torch.cuda.empty_cache()
            rows.append(row)
            print(f"| {v} | {row['step_ms']:.0f} | {row['peak_gib']:.2f} | {row['train_part_ms']:.1f} | "
                  f"{row['train_part_peak_gib']:.2f} | {100 * row['train_share']:.1f}% | {row['tokens']} | "
                  f"{row['paths']} |",
                  flush=True)
    return rows


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        parts = _csv(args.parts, PARTS, "parts")
        methods = _csv(args.methods, METHODS, "methods")
        variants = _csv(args.variants, VARIANTS, "variants")
        shapes = [_hv(s) for s in args.shapes.split(",")]
        ns = _ints(args.ns, "ns")
        for name in ("seq_len", "repeat", "e2e_steps", "e2e_batch", "e2e_completion_len"):
            if getattr(args, name) < 1:
                raise CliError(f"--{name.replace('_', '-')} must be >= 1")
        if args.warmup < 0 or not args.temperature > 0:
            raise CliError("--warmup must be >= 0 and --temperature > 0")
        if args.e2e_batch < 2:
            raise CliError("--e2e-batch must be >= 2 (one GRPO group)")
        if not torch.cuda.is_available():
            raise CliError("needs CUDA (this benchmark times GPU work)", EXIT_BLOCKED)
        try:
            import trl
        except ImportError:
            raise CliError("trl is not installed: pip install trl==1.16.0", EXIT_BLOCKED) from None
        from rlkernel import _ext

        if ("kernel" in parts and {"apply", "apply-loss"} & set(methods)) and _ext.unavailable_reason():
            raise CliError(f"the apply methods need rlkernel._C: {_ext.unavailable_reason()}", EXIT_BLOCKED)
    except CliError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return exc.code
    os.environ["RLKERNEL_VALIDATE"] = "0"
    warnings.simplefilter("ignore", FutureWarning)
    import transformers

    transformers.utils.logging.set_verbosity_error()
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, trl=trl.__version__,
                  transformers=transformers.__version__, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  argv=sys.argv[1:] if argv is None else list(argv))
    print(f"# {result['device']} | torch {result['torch']} | trl {result['trl']} | {result['date']}")
    if "kernel" in parts:
        print(f"\n## Kernel level: forward + backward of the GRPO loss, bf16, T={args.seq_len}, "
              f"median of {args.repeat}\n")
        print("| H x V | N | method | ms | wall ms | peak GiB | loss | x trl | dW accumulation |\n"
              "|---|---|---|---|---|---|---|---|---|")
        result["kernel"] = run_kernel(args, shapes, ns, methods)
    if "e2e" in parts:
        print(f"\n## End to end: GRPOTrainer, Qwen2.5-0.5B-shaped random model, bf16, {args.e2e_batch} x "
              f"{args.e2e_completion_len} tokens per step, {args.e2e_steps} steps (the first not timed)\n")
        print("| variant | step ms | peak GiB | compute_loss + backward ms | its peak GiB | share of step | "
              "tokens | rlkernel paths |\n|---|---|---|---|---|---|---|---|")
        result["e2e"] = run_e2e(args, variants)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"\nwrote {args.out}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
