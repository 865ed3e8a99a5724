"""Rollout-to-trainer check of processed log-probs: sample with per-row top-k / top-p / min-p from logits computed
from hidden states, then recompute in the trainer with rlkernel.linear_logp(..., same filters) from the same hidden
states, and report the importance ratio's spread and the kept-set membership changes.

Three ways to get the logits (rows: one per way):
- ``bf16``: the rollout's logits ``hidden @ weight.T`` in the inputs' dtype (one GEMM of the whole batch, as an
  inference engine's LM head gives them); the trainer's ``linear_logp`` computes them by its own GEMM blocks;
- ``float32``: both sides keep float32 logits from the GEMM's accumulator (``logits_dtype=torch.float32``);
- ``batch_invariant``: the rollout samples from ``rlkernel.linear_logits`` (computed in decode-sized batches of
  shuffled rows), the trainer uses ``linear_logp(..., batch_invariant=True)``: the ratio must be exactly 1 for
  every token, and no token may change kept-set membership (exit 1 otherwise).
A last row, ``unfiltered``, scores the bf16 rollout with the full-vocabulary log-prob (no filters): the extra
log S a trainer sees when it ignores the sampler's filters.

|log ratio| = |trainer log-prob - rollout log-prob| over the sampled tokens (max and quantiles); "kept changes":
the (row, token) pairs whose membership of the kept set differs between the rollout's logits and the logits the
trainer's GEMM computes (the kept sets by rlkernel's native kept-set code), the rows holding one, and the sampled
tokens the trainer finds outside its kept set (log-prob -inf there: ratio 0).

Exit codes: 0 done; 1 the batch-invariant check failed; 2 bad usage; 3 --device cuda without CUDA.
Small on CPU: ``python examples/rollout_trainer_check.py``; the H200 figures: ``python
examples/rollout_trainer_check.py --device cuda --n 16384 --hidden 4096 --vocab 128256``.
"""
from __future__ import annotations

import argparse
import math
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import rlkernel  # noqa: E402
from rlkernel import FallbackWarning  # noqa: E402
from rlkernel.cli import EXIT_BLOCKED, EXIT_CHECK_FAILED, EXIT_OK, CliError, OneLineParser, check_env_flags  # noqa: E402
from rlkernel.ops.fused import linear_logp_processed as fused_processed  # noqa: E402
from rlkernel.ops.linear_logits import logits_rows  # noqa: E402
from rlkernel.ops.native import linear_logp_processed as native_processed  # noqa: E402
from rlkernel.ops.native.filters import Filtered  # noqa: E402

PROG = "rollout_trainer_check"
QUANTILES = (0.5, 0.9, 0.99, 0.999)
DECODE_BATCH = 1000  # rows per rollout batch in the batch-invariant mode (not a divisor of n: partial batches)


def build_parser():
    p = OneLineParser(prog=PROG, description=__doc__.split("\n")[0],
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--n", type=int, default=512, help="tokens (rows)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size H")
    p.add_argument("--vocab", type=int, default=2000, help="vocabulary size V")
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    return p


def per_row_settings(n, device, gen):
    """A mix of settings per row, as rollouts of different requests have: top_k in {0, 20, 50, 1024}, top_p in
    {1, 0.95, 0.9, 0.7}, min_p in {0, 0, 0.05}, T in {0.7, 1, 1.2} (every 64th row greedy, T = 0)."""
    def pick(values, dtype):
        idx = torch.randint(0, len(values), (n,), generator=gen)
        return torch.tensor(values, dtype=dtype)[idx].to(device)

    t = pick((0.7, 1.0, 1.2), torch.float32)
    t[::64] = 0.0
    return dict(temperature=t, top_k=pick((0, 20, 50, 1024), torch.int64),
                top_p=pick((1.0, 0.95, 0.9, 0.7), torch.float32), min_p=pick((0.0, 0.0, 0.05), torch.float32))


def trainer_logits(hidden, weight, batch_invariant, logits32, device):
    """The logits the trainer's linear_logp computes, by its own GEMM calls (the same block rows), so the kept sets
    compared are those the two sides really use."""
    n, vocab = hidden.shape[0], weight.shape[0]
    if device.type == "cuda" and not batch_invariant:
        block = fused_processed.block_rows(n, vocab, torch.float32 if logits32 else hidden.dtype, False)
    else:
        block = native_processed.chunk_rows(vocab)
    return torch.cat([logits_rows(hidden[r0:r0 + block], weight, None, batch_invariant, logits32)
                      for r0 in range(0, n, block)])


def kept_changes(rollout_logits, train_logits, filters, rows_per_chunk=256):
    """(pairs, rows) whose kept-set membership differs between the two logits (native kept-set code, by chunks)."""
    pairs = rows = 0
    n = rollout_logits.shape[0]
    for r0 in range(0, n, rows_per_chunk):
        r1 = min(n, r0 + rows_per_chunk)
        sub = [filters[k][r0:r1] for k in ("temperature", "top_k", "top_p", "min_p")]
        a = Filtered(rollout_logits[r0:r1], *sub).kept
        b = Filtered(train_logits[r0:r1], *sub).kept
        diff = a != b
        pairs += int(diff.sum())
        rows += int(diff.any(-1).sum())
    return pairs, rows


def spread(train_lp, roll_lp):
    """max, quantiles of |log ratio| over the tokens both sides keep, and the tokens the trainer drops."""
    both = torch.isfinite(train_lp) & torch.isfinite(roll_lp)
    d = (train_lp[both].double() - roll_lp[both].double()).abs().cpu()
    dropped = int((torch.isfinite(roll_lp) & ~torch.isfinite(train_lp)).sum())
    qs = torch.quantile(d, torch.tensor(QUANTILES, dtype=torch.float64)).tolist() if d.numel() else [math.nan] * 4
    ratio = torch.exp(train_lp[both].double() - roll_lp[both].double())
    outside = float(((ratio < 0.9) | (ratio > 1.1)).double().mean()) if ratio.numel() else math.nan
    return dict(max=float(d.max()) if d.numel() else math.nan, q=qs, dropped=dropped,
                mean_ratio=float(ratio.mean()) if ratio.numel() else math.nan, outside=outside)


def run_mode(mode, hidden, weight, filters, device, gen_seed):
    n = hidden.shape[0]
    logits32 = mode == "float32"
    bi = mode == "batch_invariant"
    logits_dtype = torch.float32 if logits32 else None
    if bi:  # the rollout: shuffled rows in decode-sized batches, each through linear_logits
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(gen_seed + 1)).to(device)
        roll_logits = torch.empty(n, weight.shape[0], dtype=hidden.dtype, device=device)
        for b0 in range(0, n, DECODE_BATCH):
            rows = perm[b0:b0 + DECODE_BATCH]
            roll_logits[rows] = rlkernel.linear_logits(hidden[rows], weight)
    elif logits32:
        roll_logits = rlkernel.linear_logits(hidden, weight, batch_invariant=False, logits_dtype=torch.float32)
    else:
        roll_logits = hidden @ weight.T
    ids, roll_lp = rlkernel.sample(roll_logits, seed=gen_seed, return_logprobs="processed", **filters)
    train_lp = rlkernel.linear_logp(hidden, weight, ids, batch_invariant=bi, logits_dtype=logits_dtype, **filters)
    train_logits = trainer_logits(hidden, weight, bi, logits32, device)
    pairs, rows = kept_changes(roll_logits, train_logits, filters)
    out = spread(train_lp, roll_lp)
    out.update(pairs=pairs, rows=rows, exact=bool(torch.equal(train_lp, roll_lp)))
    if mode == "bf16":  # a trainer that ignores the filters: the full-vocabulary log-prob at the sampler's T
        t = torch.where(filters["temperature"] > 0, filters["temperature"], torch.ones_like(filters["temperature"]))
        plain = rlkernel.linear_logp(hidden, weight, ids, temperature=t)  # per-row T, no filter: full vocabulary
        out["unfiltered"] = spread(plain.view(-1), roll_lp)
    return out


def print_row(name, r):
    q = "  ".join(f"{v:.3g}" for v in r["q"])
    print(f"{name:<16} {r['max']:<10.3g} {q:<34} {r['mean_ratio']:<10.6f} {r['outside']:<8.4f} "
          f"{r.get('pairs', '-'):<8} {r.get('rows', '-'):<6} {r['dropped']}")


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        check_env_flags()  # a bad RLKERNEL_* value: one line, exit 2, before any work
    except CliError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return exc.code
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"{PROG}: --device cuda but CUDA is not available", file=sys.stderr)
        return EXIT_BLOCKED
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    warnings.simplefilter("ignore", FallbackWarning)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(args.seed)
    # logits with a realistic spread: std ~ 2.5 (peaked rows, long tails)
    hidden = torch.randn(args.n, args.hidden, generator=gen).to(device, dtype)
    weight = (torch.randn(args.vocab, args.hidden, generator=gen) * (2.5 / math.sqrt(args.hidden))).to(device, dtype)
    filters = per_row_settings(args.n, device, gen)
    print(f"{PROG}: N={args.n} H={args.hidden} V={args.vocab} {args.dtype} on {device} "
          f"(backend of sample/linear_logp: {'fused' if device.type == 'cuda' else 'native'})")
    print(f"{'logits':<16} {'max|dlog|':<10} {'|dlog| p50 p90 p99 p99.9':<34} {'mean r':<10} {'r!~1±.1':<8} "
          f"{'kept chg':<8} {'rows':<6} dropped")
    results = {}
    for mode in ("bf16", "float32", "batch_invariant"):
        results[mode] = run_mode(mode, hidden, weight, filters, device, args.seed)
        print_row(mode if mode != "bf16" else args.dtype.replace("bfloat16", "bf16"), results[mode])
    print_row("unfiltered", results["bf16"]["unfiltered"])
    bi = results["batch_invariant"]
    if not (bi["exact"] and bi["pairs"] == 0 and bi["dropped"] == 0):
        print(f"{PROG}: batch_invariant: the trainer's log-probs are not bitwise the rollout's (max |dlog| "
              f"{bi['max']:.3g}, {bi['pairs']} kept-set changes)", file=sys.stderr)
        return EXIT_CHECK_FAILED
    print(f"{PROG}: batch_invariant: ratio exactly 1 for all {args.n} tokens, no kept-set change")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
