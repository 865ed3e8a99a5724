"""Log-prob forward and forward+backward, fused vs its peers, on the same inputs in one run (issue 4).

    python benchmarks/bench_logp.py                       # every shape of the issue (H200: ~3 minutes)
    python benchmarks/bench_logp.py --shapes 16384x128256 --repeat 100
    python benchmarks/bench_logp.py --processed       # processed (filtered) forward vs plain fused forward (issue 20)

Per shape: one [N+1, V] buffer of seeded random logits (Liger's selective log-softmax scores the first N rows of
[1, N+1, V]; every other method reads the first N rows of the same buffer), median of --repeat runs timed each by
its own pair of CUDA events after --warmup runs. Every input here is far larger than the 60 MB L2, so one buffer
is never served from L2 (shapes smaller than 4x the L2 rotate through several copies). Methods that overwrite the
logits (fused in-place backward, Liger's cross-entropy) get a fresh copy before each run, outside the events.
Bytes per method are the least the task must move: forward = one read of the logits; forward+backward = two reads
and one write of the gradient. Ceilings measured in the same run: a read-only streaming kernel over the same bytes,
and a device-to-device copy. RLKERNEL_VALIDATE=0 while timing: the id check's one small copy syncs the host.
Writes reports/bench_logp-<UTC time>.csv. Exit codes: 0 done, 2 bad arguments, 3 no CUDA / extension not built.
"""
from __future__ import annotations

import csv
import datetime as dt
import os
import sys

import torch
from _timing import events_median, peak_extra  # beside this script: on sys.path when it runs

from rlkernel.cli import CliError, OneLineParser

L2_BYTES = 60 * 1024 * 1024
DEFAULT_SHAPES = [(n, v) for n in (4096, 16384, 32768) for v in (32000, 128256, 151936)]


def _read_ceiling_fn(x: torch.Tensor):
    """A read-only streaming kernel over x's bytes (Triton; torch.amax when Triton is missing)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return "torch.amax", lambda: torch.amax(x)

    @triton.jit
    def _read(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(ITERS):
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0, eviction_policy="evict_first").to(tl.float32)
        tl.store(out_ptr + tl.program_id(0), tl.sum(acc))

    flat = x.view(-1).view(torch.int32) if x.element_size() == 2 and x.numel() % 2 == 0 else x.view(-1)
    block, iters = 2048, 16
    grid = (triton.cdiv(flat.numel(), block * iters),)
    out = torch.empty(grid[0], device=x.device, dtype=torch.float32)
    return "triton read", lambda: _read[grid](flat, out, flat.numel(), BLOCK=block, ITERS=iters, num_warps=4)


def _native_logp(x, ids):
    return torch.log_softmax(x.float(), dim=-1).gather(-1, ids[:, None])[:, 0]


def bench_shape(n: int, v: int, dtype, warmup: int, repeat: int, compiled_native) -> list[dict]:
    import rlkernel

    gen = torch.Generator(device="cuda").manual_seed(n * 131 + v)
    nbytes = (n + 1) * v * torch.tensor([], dtype=dtype).element_size()
    copies = max(1, -(-4 * L2_BYTES // nbytes))  # rotate when one buffer could sit in L2
    bufs = [(torch.randn(n + 1, v, device="cuda", generator=gen) * 4).to(dtype) for _ in range(copies)]
    pristine = bufs[0].clone()  # the in-place methods' fresh copy
    ids = torch.randint(0, v, (n,), device="cuda", generator=gen)
    g = torch.randn(n, device="cuda", generator=gen)
    state = {"i": 0}

    def cur():
        return bufs[state["i"] % copies]

    def rotate():
        state["i"] += 1

    def restore():
        rotate()
        cur().copy_(pristine)

    def x():
        return cur()[:n]

    elem = bufs[0].element_size()
    read_bytes = n * v * elem
    rows = []

    def fwd_bwd(fn):
        def run():
            leaf = x().detach().requires_grad_(True)
            torch.autograd.grad(fn(leaf), leaf, g)
        return run

    def liger_ce(leaf):
        from liger_kernel.transformers import LigerCrossEntropyLoss

        return -LigerCrossEntropyLoss(reduction="none")(leaf, ids)

    def liger_fwd():
        from liger_kernel.ops.grpo_loss import fused_selective_log_softmax

        return fused_selective_log_softmax(cur().view(1, n + 1, v), ids.view(1, n), temperature=1.0)

    dst = {}

    def copy():  # the copy ceiling's destination is allocated once, on first use
        if "t" not in dst:
            dst["t"] = torch.empty_like(x())
        dst["t"].copy_(x())

    fused = lambda leaf, inplace=False: rlkernel.logp(leaf, ids, backend="fused", inplace_backward=inplace)
    methods = [
        ("copy ceiling (read+write)", "ceiling", copy, rotate, 2 * read_bytes),
        ("fused forward", "forward", lambda: fused(x()), rotate, read_bytes),
        ("native fp32 forward", "forward", lambda: _native_logp(x(), ids), rotate, read_bytes),
        ("torch.compile native forward", "forward", lambda: compiled_native(x(), ids), rotate, read_bytes),
        ("fused forward+backward", "fwd+bwd", fwd_bwd(fused), rotate, 3 * read_bytes),
        ("fused forward+backward in place", "fwd+bwd", fwd_bwd(lambda t: fused(t, True)), restore, 3 * read_bytes),
        ("native fp32 forward+backward", "fwd+bwd", fwd_bwd(lambda t: _native_logp(t, ids)), rotate, 3 * read_bytes),
    ]
    try:
        import liger_kernel  # noqa: F401

        methods += [
            ("liger fused_selective_log_softmax", "forward", liger_fwd, rotate, read_bytes),
            ("liger CrossEntropy(none) fwd+bwd", "fwd+bwd", fwd_bwd(liger_ce), restore, 3 * read_bytes),
        ]
    except ImportError:
        print("liger-kernel not importable: its rows are absent", file=sys.stderr)
    ceiling_name, ceiling_fn = _read_ceiling_fn(x())
    methods.insert(0, (f"read ceiling ({ceiling_name})", "ceiling", ceiling_fn, rotate, read_bytes))

    for name, kind, fn, prep, moved in methods:
        try:
            ms = events_median(fn, prep, warmup, repeat)
            extra = peak_extra(fn, prep)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            rows.append(dict(method=name, kind=kind, ms="OOM"))
            continue
        rows.append(dict(method=name, kind=kind, ms=ms, bytes=moved, tbps=moved / ms / 1e9, peak_extra=extra))
    ceiling = rows[0]["tbps"]
    for r in rows:
        r.update(n=n, v=v, dtype=str(dtype).removeprefix("torch."))
        if r["ms"] != "OOM":
            r["pct_read_ceiling"] = 100 * r["tbps"] / ceiling
            r["logits_bytes"] = read_bytes
    bufs.clear()  # free this shape's buffers before the next shape allocates
    dst.clear()
    torch.cuda.empty_cache()
    return rows


PROCESSED_FILTERS = [  # (label, top_k, top_p): every row T = 1, min_p 0
    ("k=50 p=0.9", 50, 0.9), ("k=128 p=0.9", 128, 0.9), ("k=50 p=1", 50, 1.0), ("k=0 p=0.9 (whole-row select)", 0, 0.9),
]


def bench_processed(n: int, v: int, dtype, warmup: int, repeat: int) -> list[dict]:
    """The processed forward (kept set on the device, the sampler's filter code) next to the plain fused forward on
    the same logits, as Python numbers and as per-row tensors."""
    import rlkernel

    gen = torch.Generator(device="cuda").manual_seed(n * 7 + v)
    nbytes = n * v * torch.tensor([], dtype=dtype).element_size()
    copies = max(1, -(-4 * L2_BYTES // nbytes))
    bufs = [(torch.randn(n, v, device="cuda", generator=gen) * 4).to(dtype) for _ in range(copies)]
    ids = torch.randint(0, v, (n,), device="cuda", generator=gen)
    state = {"i": 0}

    def rotate():
        state["i"] += 1

    def x():
        return bufs[state["i"] % copies]

    methods = [("plain fused forward", lambda: rlkernel.logp(x(), ids, backend="fused"))]
    for label, k, p in PROCESSED_FILTERS:
        methods.append((f"processed {label}", lambda k=k, p=p: rlkernel.logp(x(), ids, top_k=k, top_p=p,
                                                                             backend="fused")))
    rows_k = torch.full((n,), 50, dtype=torch.int64, device="cuda")
    rows_p = torch.full((n,), 0.9, dtype=torch.float32, device="cuda")
    methods.append(("processed k=50 p=0.9 per-row tensors",
                    lambda: rlkernel.logp(x(), ids, top_k=rows_k, top_p=rows_p, backend="fused")))
    out = []
    for name, fn in methods:
        ms = events_median(fn, rotate, warmup, repeat)
        out.append(dict(method=name, ms=ms, n=n, v=v, dtype=str(dtype).removeprefix("torch.")))
    base = out[0]["ms"]
    for r in out:
        r["x_plain"] = r["ms"] / base
    bufs.clear()
    torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = OneLineParser(prog="bench_logp", description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=None, help="comma-separated NxV (default: the issue's 9 shapes)")
    ap.add_argument("--fp32-shape", default="4096x128256", help="one NxV also run in float32 ('' for none)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=100)
    ap.add_argument("--out", default="reports")
    ap.add_argument("--processed", action="store_true",
                    help="only the processed-forward table (default shape 16384x128256 bf16; --shapes to change)")
    try:
        args = ap.parse_args(argv)
        parse = lambda s: tuple(int(p) for p in s.lower().split("x"))
        shapes = [parse(s) for s in args.shapes.split(",")] if args.shapes else DEFAULT_SHAPES
        fp32 = [parse(args.fp32_shape)] if args.fp32_shape else []
        if args.repeat < 1 or args.warmup < 0 or any(len(s) != 2 or min(s) < 1 for s in shapes + fp32):
            raise ValueError("shapes are NxV with N, V >= 1; --repeat >= 1")
    except (ValueError, CliError) as exc:
        print(f"bench_logp: bad arguments: {exc}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_logp: needs a CUDA GPU (none visible)", file=sys.stderr)
        return 3
    from rlkernel import _ext, env

    if _ext.unavailable_reason():
        print(f"bench_logp: {_ext.unavailable_reason()} (python -m rlkernel.env says why)", file=sys.stderr)
        return 3
    os.environ["RLKERNEL_VALIDATE"] = "0"
    dev = env.device_record(torch.cuda.current_device())
    datasheet = dev.get("memory_bandwidth_bytes_per_s")
    if args.processed:
        desc = env.describe()
        print(f"# {dev.get('name')} | CUDA {desc.get('cuda_runtime')} | torch {desc.get('torch')} | "
              f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d} | median of {args.repeat} after {args.warmup} warm-up")
        print("| dtype | N | V | method | ms | x plain fused forward | command |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for n, v in (shapes if args.shapes else [(16384, 128256)]):
            for r in bench_processed(n, v, torch.bfloat16, args.warmup, args.repeat):
                cmd = f"python benchmarks/bench_logp.py --processed --shapes {n}x{v} --repeat {args.repeat}"
                print(f"| {r['dtype']} | {n} | {v} | {r['method']} | {r['ms']:.3f} | {r['x_plain']:.2f} | `{cmd}` |",
                      flush=True)
        return 0
    compiled_native = torch.compile(_native_logp, dynamic=True)
    rows = []
    for dtype, shape_list in ((torch.bfloat16, shapes), (torch.float32, fp32)):
        for n, v in shape_list:
            rows += bench_shape(n, v, dtype, args.warmup, args.repeat, compiled_native)
    desc = env.describe()
    print(f"# {dev.get('name')} | driver {desc.get('driver')} | CUDA {desc.get('cuda_runtime')} | torch "
          f"{desc.get('torch')} | {dt.datetime.now(dt.timezone.utc):%Y-%m-%d} | median of {args.repeat} after "
          f"{args.warmup} warm-up | datasheet-class bandwidth {datasheet / 1e12 if datasheet else float('nan'):.2f}"
          f" TB/s ({dev.get('memory_bandwidth_source', 'device properties')})")
    print("| dtype | N | V | method | ms | TB/s | % read ceiling | % datasheet | peak extra MB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if r["ms"] == "OOM":
            print(f"| {r['dtype']} | {r['n']} | {r['v']} | {r['method']} | OOM | | | | |")
            continue
        r["pct_datasheet"] = 100 * r["tbps"] * 1e12 / datasheet if datasheet else None
        pds = f"{r['pct_datasheet']:.1f}" if datasheet else "n/a"
        print(f"| {r['dtype']} | {r['n']} | {r['v']} | {r['method']} | {r['ms']:.3f} | {r['tbps']:.2f} | "
              f"{r['pct_read_ceiling']:.1f} | {pds} | {r['peak_extra'] / 2**20:.1f} |")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"bench_logp-{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%SZ}.csv")
    keys = ["dtype", "n", "v", "method", "kind", "ms", "bytes", "tbps", "pct_read_ceiling", "pct_datasheet",
            "peak_extra", "logits_bytes"]
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
