"""Fused top-k/top-p sampling against the two native PyTorch ways and FlashInfer (where it imports), on device time.

    python benchmarks/bench_sampling.py [--batches 1,32,64,128,256] [--vocab 128256] [--dtypes float32,bfloat16]
                                        [--top-k 50] [--top-p 0.9] [--reps 200] [--logprobs]

Paths, all drawing from the same law (rlkernel.sample's):
  fused  rlkernel.sample(backend="fused") with the settings as Python numbers and a generator (RLKERNEL_VALIDATE=0:
         no 4-byte read-back sync per call)
  rows   the same settings as per-row tensors (temperature, top_k, top_p, min_p = 0) and a seed and an offset per
         row (issue 20: target <= 1.1x the scalar fused call)
  sort   rlkernel's native path: softmax, a stable sort of the whole vocabulary, cumsum, multinomial
  topk   torch.topk(k) first, then softmax / top-p / multinomial on the k survivors
  flashinfer  flashinfer.sampling.top_k_top_p_sampling_from_logits(filter_apply_order="top_k_first") on logits / T,
         where flashinfer imports (on a GPU node: `source .fi/env.sh`, made by tools/flashinfer_kit.sh); otherwise one
         line "flashinfer: not available (<reason>)" and the other columns
--logprobs times, instead of the table above, the fused calls with their log-probs against the same calls without:
  return_logprobs="processed" and True (the raw log-prob), both out of the sampler's own pass (issue 38: target
  <= 1.15x each), for the scalar call (generator) and the per-row one (rows)
Each call is timed alone with CUDA events while the GPU is kept busy ahead of the host (torch.cuda._sleep), so
host launch overhead is not counted; the inputs rotate over enough buffers to exceed the L2 cache; the median of
--reps calls is reported, with the bandwidth of reading the logits once (bytes / median).
"""
from __future__ import annotations

import datetime
import os
import statistics
import sys

import torch

os.environ["RLKERNEL_VALIDATE"] = "0"  # before rlkernel reads it

import rlkernel  # noqa: E402
from rlkernel.cli import CliError, OneLineParser
from rlkernel.ops.native.sampling import sample_native  # noqa: E402

L2_BYTES = 60 * 2**20  # H200: 60 MB of L2 (torch.cuda.get_device_properties reports it too)


def topk_path(logits, temperature, top_k, top_p, generator):
    vals, idx = torch.topk(logits.float(), top_k, dim=-1)  # sorted, descending
    p = torch.softmax(vals / temperature, dim=-1)
    before = torch.cumsum(p, dim=-1) - p
    p = torch.where(before < top_p, p, torch.zeros_like(p))
    pick = torch.multinomial(p, 1, generator=generator)
    return idx.gather(-1, pick).squeeze(-1)


def flashinfer_path(temperature, top_k, top_p, generator):
    """(the FlashInfer call, its version) or (None, why it cannot run): one small call loads its kernels first."""
    try:
        import flashinfer.sampling as fis

        def fn(x):
            return fis.top_k_top_p_sampling_from_logits(x if temperature == 1 else x / temperature, top_k, top_p,
                                                        filter_apply_order="top_k_first", generator=generator)
        fn(torch.randn(2, 65536, device="cuda"))
        return fn, getattr(sys.modules["flashinfer"], "__version__", "?")
    except Exception as exc:  # not installed, its JIT failed, no kernel for this GPU: say so, time the rest
        return None, f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"


def time_path(fn, inputs, reps):
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(3):  # warm-up: allocator, registration
        fn(inputs[i % len(inputs)])
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9 * 0.05))  # ~50 ms of GPU work queued ahead of the timed calls
    for i in range(reps):
        starts[i].record()
        fn(inputs[i % len(inputs)])
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)) * 1e3  # microseconds


def _per_row(b, args):
    """The settings as per-row tensors, with a seed and an offset per row (a rollout engine's call)."""
    return dict(temperature=torch.full((b,), args.temperature, device="cuda"),
                top_k=torch.full((b,), args.top_k, dtype=torch.int64, device="cuda"),
                top_p=torch.full((b,), args.top_p, device="cuda"), min_p=torch.zeros(b, device="cuda"),
                seed=torch.arange(b, device="cuda") * 7919 + 1, offset=torch.arange(b, device="cuda"))


def _inputs(b, dtype, vocab):
    nbytes = b * vocab * torch.finfo(dtype).bits // 8
    n_buf = max(2, -(-4 * L2_BYTES // nbytes))  # >= 4x the L2 in total
    return [torch.randn(b, vocab, device="cuda", dtype=dtype) * 3 for _ in range(n_buf)]


def logprob_table(args, kw, props) -> int:
    """--logprobs: each call with return_logprobs="processed" and True against the same call without."""
    print(f"# {props.name}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}, V={args.vocab}, top_k={args.top_k}, "
          f"top_p={args.top_p}, T={args.temperature}, median of {args.reps} calls (us)")
    print("| dtype | B | call | plain | processed | processed / plain | raw (True) | raw / plain | command |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
        for b in [int(x) for x in args.batches.split(",")]:
            inputs = _inputs(b, dtype, args.vocab)
            d = str(dtype).removeprefix("torch.")
            cmd = (f"python benchmarks/bench_sampling.py --logprobs --batches {b} --dtypes {d} --vocab {args.vocab} "
                   f"--top-k {args.top_k} --top-p {args.top_p} --reps {args.reps}")
            for call, settings in (("scalar", kw), ("rows", _per_row(b, args))):
                us = {lp: time_path(lambda x, s=settings, lp=lp: rlkernel.sample(
                    x, backend="fused", return_logprobs=lp, **s), inputs, args.reps)
                    for lp in (False, "processed", True)}
                plain = us[False]
                print(f"| {d} | {b} | {call} | {plain:.1f} | {us['processed']:.1f} | {us['processed'] / plain:.2f} | "
                      f"{us[True]:.1f} | {us[True] / plain:.2f} | `{cmd}` |", flush=True)
            del inputs
    print("dispatch:", rlkernel.dispatch.history_json())
    return 0


def main() -> int:
    ap = OneLineParser(prog="bench_sampling", description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,32,64,128,256")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--top-k", type=int, default=50)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--logprobs", action="store_true", help="time the calls with return_logprobs (see above)")
    try:
        args = ap.parse_args()
    except CliError as exc:
        print(f"bench_sampling: {exc}", file=sys.stderr)
        return exc.code
    if args.reps < 100:
        print("bench_sampling: --reps must be >= 100 (a median of at least 100 calls)", file=sys.stderr)
        return 2
    try:
        batches = [int(x) for x in args.batches.split(",")]
    except ValueError:
        batches = []
    dtypes = args.dtypes.split(",")
    bad = ("--batches must be comma-separated integers >= 1" if not batches or min(batches) < 1
           else f"--dtypes: each of float32, bfloat16, float16, got {args.dtypes!r}"
           if not set(dtypes) <= {"float32", "bfloat16", "float16"}
           else "--vocab must be >= 1" if args.vocab < 1
           else "--top-k must be >= 0" if args.top_k < 0 else "--top-p must be in (0, 1]" if not 0 < args.top_p <= 1
           else "--temperature must be > 0" if not args.temperature > 0
           else "--top-k 0 (no top-k) is timed with --logprobs only: the table's topk column needs k >= 1"
           if args.top_k == 0 and not args.logprobs else None)
    if bad:
        print(f"bench_sampling: {bad}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_sampling: needs a CUDA GPU (none visible)", file=sys.stderr)
        return 3
    reason = rlkernel.dispatch.fused_unavailable_reason("sample", torch.device("cuda"), torch.float32)
    if reason:  # nothing fused to measure: say so instead of timing the native path under a fused name
        print(f"bench_sampling: the fused sampler cannot run here: {reason}", file=sys.stderr)
        return 3
    props = torch.cuda.get_device_properties(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    kw = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, generator=gen)
    if args.logprobs:
        return logprob_table(args, kw, props)
    fi_fn, fi_version = flashinfer_path(**kw)
    if fi_fn is None:
        print(f"flashinfer: not available ({fi_version})")
    print(f"# {props.name}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}, V={args.vocab}, top_k={args.top_k}, "
          f"top_p={args.top_p}, T={args.temperature}, median of {args.reps} calls (us)"
          + (f", flashinfer {fi_version}" if fi_fn else ""))
    fi_head = (" flashinfer | flashinfer / fused |", " --- | --- |") if fi_fn else ("", "")
    print("| dtype | B | fused | rows (per-row + seeds) | rows / fused | sort (native) | topk | fused GB/s | "
          f"x vs topk |{fi_head[0]} command |")
    print(f"| --- | --- | --- | --- | --- | --- | --- | --- | --- |{fi_head[1]} --- |")
    paths = {
        "fused": lambda x: rlkernel.sample(x, backend="fused", **kw),
        "rows": None,  # per batch size: rows_path(b)
        "sort": lambda x: sample_native(x, **kw),
        "topk": lambda x: topk_path(x, **kw),
        **({"flashinfer": fi_fn} if fi_fn else {}),
    }
    def rows_path(b):
        per_row = dict(temperature=torch.full((b,), args.temperature, device="cuda"),
                       top_k=torch.full((b,), args.top_k, dtype=torch.int64, device="cuda"),
                       top_p=torch.full((b,), args.top_p, device="cuda"), min_p=torch.zeros(b, device="cuda"),
                       seed=torch.arange(b, device="cuda") * 7919 + 1, offset=torch.arange(b, device="cuda"))
        return lambda x: rlkernel.sample(x, backend="fused", **per_row)

    for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
        for b in [int(x) for x in args.batches.split(",")]:
            paths["rows"] = rows_path(b)
            nbytes = b * args.vocab * torch.finfo(dtype).bits // 8
            inputs = _inputs(b, dtype, args.vocab)
            us = {name: time_path(fn, inputs, args.reps) for name, fn in paths.items()}
            d = str(dtype).removeprefix("torch.")
            cmd = (f"python benchmarks/bench_sampling.py --batches {b} --dtypes {d} --vocab {args.vocab} "
                   f"--top-k {args.top_k} --top-p {args.top_p} --reps {args.reps}")
            fi_cols = f" {us['flashinfer']:.1f} | {us['flashinfer'] / us['fused']:.2f} |" if fi_fn else ""
            print(f"| {d} | {b} | {us['fused']:.1f} | {us['rows']:.1f} | {us['rows'] / us['fused']:.2f} | "
                  f"{us['sort']:.1f} | {us['topk']:.1f} | {nbytes / us['fused'] / 1e3:.0f} | "
                  f"{us['topk'] / us['fused']:.1f} |{fi_cols} `{cmd}` |", flush=True)
            del inputs
    print("dispatch:", rlkernel.dispatch.history_json())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
