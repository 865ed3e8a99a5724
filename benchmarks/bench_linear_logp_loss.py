"""rlkernel.linear_logp_loss (forward + gradients of hidden and weight) against a bare matmul and Liger-Kernel's
fused linear cross-entropy with per-token output, on the same inputs in one run (issue 21).

    python benchmarks/bench_linear_logp_loss.py                           # N=16384, H=4096, V=128256, bf16
    python benchmarks/bench_linear_logp_loss.py --shapes 4096x896x151936 --methods loss,matmul --repeat 10

Methods (each a row; the reproduction command is printed beside it):
- ``matmul``: ``torch.mm(hidden, weight.T, out=...)`` into a preallocated [N, V] buffer (cuBLAS), the unit;
- ``loss``: ``rlkernel.linear_logp_loss(..., backend="fused")`` with a GRPO clipped objective + entropy bonus as
  loss_fn, then ``loss.backward()`` (hidden and weight require grad): three GEMMs per chunk;
- ``loss-native``: the same call with ``backend="native"`` (chunked PyTorch);
- ``loss-epi``, ``fwd-loss-epi`` / ``fwd-loss``: ``loss`` with the epilogue GEMM (issue 37,
  ``rlkernel.ops.fused.epilogue_gemm.ENABLED``: its forward, and its gradient epilogue in the backward, which writes
  the chunk's 16-bit gradient from the recompute GEMM), and the loss without gradients (forward half only) with and
  without it; ``loss-epi-tile``: ``loss-epi`` with the gradient epilogue off (``GRAD = False``: the backward's float32
  logits buffer, logp backward kernel and cast); ``loss-epi-pp``, ``fwd-loss-epi-pp``: its ping-pong
  config (``CONFIG = 1``, bf16); ``loss-epi-c2``, ``fwd-loss-epi-c2``: its 2 x 1 cluster config (``CONFIG = 2``);
- ``loss-f32``, ``fwd-loss-f32``: ``loss`` / ``fwd-loss`` with ``logits_dtype=torch.float32`` on the cuBLAS path
  (epilogue GEMM off: the float32-output GEMM, its float32 logits buffer kept for the backward); ``loss-f32-auto``,
  ``fwd-loss-f32-auto``: the same calls under ``ENABLED = "auto"``, whatever it takes there (recorded in the note);
- ``liger``: ``LigerFusedLinearCrossEntropyLoss(reduction="none")(weight, hidden, ids).sum().backward()``
  (it too computes its gradients in the forward; cross-entropy only, no entropy).
Median of --repeat runs, each timed by its own pair of CUDA events after --warmup runs; gradients reset to None
before each run, outside the events. Peak memory: the most allocated during one run beyond what was allocated
before it (the inputs), so the returned gradients count in it. TFLOP/s counts the loss as 3 GEMMs (2 N H V each),
the matmul as one; ``x matmul`` is the time over the matmul's in the same run (target for ``loss``: <= 3.3).
RLKERNEL_VALIDATE=0 while timing (as bench_logp). Exit codes: 0 done, 2 bad arguments, 3 no CUDA / extension not
built (``loss`` needs it).
"""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from _timing import events_median, parse_nhv, peak_extra  # noqa: E402 (beside this script: on sys.path when it runs)

from rlkernel.cli import EXIT_BLOCKED, EXIT_OK, CliError, OneLineParser  # noqa: E402

METHODS = ("matmul", "loss", "loss-native", "liger", "loss-epi", "loss-epi-tile", "fwd-loss", "fwd-loss-epi",
           "loss-epi-pp", "fwd-loss-epi-pp", "loss-epi-c2", "fwd-loss-epi-c2", "loss-f32", "fwd-loss-f32",
           "loss-f32-auto", "fwd-loss-f32-auto")
DEFAULT_METHODS = ("matmul", "loss", "liger")


def build_parser():
    p = OneLineParser(prog="bench_linear_logp_loss", description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="16384x4096x128256", help="comma-separated NxHxV (default: %(default)s)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma-separated, of {', '.join(METHODS)} (default: %(default)s)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--chunk-size", type=int, default=None, help="linear_logp_loss chunk (default: its own)")
    p.add_argument("--temperature", type=float, default=1.0)
    return p


def grpo_loss_fn(adv, old, eps=0.2, coef=0.01):
    def loss_fn(lp, ent, sl):
        ratio = torch.exp(lp - old[sl])
        a = adv[sl]
        return -torch.minimum(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a) - coef * ent
    return loss_fn


def make_methods(n, h, v, dtype, args):
    import rlkernel

    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = (torch.randn(n, h, device="cuda", generator=g) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, device="cuda", generator=g) / h ** 0.5).to(dtype).requires_grad_()
    ids = torch.randint(0, v, (n,), device="cuda", generator=g)
    adv = torch.randn(n, device="cuda", generator=g)
    old = -torch.rand(n, device="cuda", generator=g) * 10
    fn = grpo_loss_fn(adv, old)

    def reset():
        hidden.grad = None
        weight.grad = None

    out = {}
    buf = {}

    def mm_prep():  # the [N, V] output, allocated once, outside the events
        if "out" not in buf:
            buf["out"] = torch.empty(n, v, device="cuda", dtype=dtype)

    def mm():
        torch.mm(hidden.detach(), weight.detach().t(), out=buf["out"])

    out["matmul"] = (mm, mm_prep)

    def loss(backend, epilogue=False, grad=True, config=0, grad_epilogue=True, logits_dtype=None):
        from rlkernel.ops.fused import epilogue_gemm

        def run():
            saved = epilogue_gemm.ENABLED, epilogue_gemm.CONFIG, epilogue_gemm.GRAD
            epilogue_gemm.ENABLED, epilogue_gemm.CONFIG, epilogue_gemm.GRAD = epilogue, config, grad_epilogue
            try:
                with torch.set_grad_enabled(grad):
                    out = rlkernel.linear_logp_loss(hidden, weight, ids, fn, temperature=args.temperature,
                                                    backend=backend, chunk_size=args.chunk_size,
                                                    logits_dtype=logits_dtype)
                    if grad:
                        out.backward()
            finally:
                epilogue_gemm.ENABLED, epilogue_gemm.CONFIG, epilogue_gemm.GRAD = saved
        return run, reset

    out["loss"] = loss("fused")
    out["loss-native"] = loss("native")
    out["loss-epi"] = loss("fused", epilogue=True)
    out["loss-epi-tile"] = loss("fused", epilogue=True, grad_epilogue=False)
    out["fwd-loss"] = loss("fused", grad=False)
    out["fwd-loss-epi"] = loss("fused", epilogue=True, grad=False)
    out["loss-epi-pp"] = loss("fused", epilogue=True, config=1)
    out["fwd-loss-epi-pp"] = loss("fused", epilogue=True, grad=False, config=1)
    out["loss-epi-c2"] = loss("fused", epilogue=True, config=2)
    out["fwd-loss-epi-c2"] = loss("fused", epilogue=True, grad=False, config=2)
    for suffix, enabled in (("", False), ("-auto", "auto")):
        out[f"loss-f32{suffix}"] = loss("fused", epilogue=enabled, logits_dtype=torch.float32)
        out[f"fwd-loss-f32{suffix}"] = loss("fused", epilogue=enabled, grad=False, logits_dtype=torch.float32)

    def liger():
        try:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        except ImportError as exc:
            return f"liger_kernel not importable ({exc})"
        ce = LigerFusedLinearCrossEntropyLoss(reduction="none")

        def run():
            res = ce(weight, hidden, ids)
            res = res if isinstance(res, torch.Tensor) else res.loss  # newer versions may return an output record
            res.sum().backward()
        return run, reset

    out["liger"] = liger()
    return out


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        shapes = [parse_nhv(s) for s in args.shapes.split(",")]
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        bad = [m for m in methods if m not in METHODS]
        if bad:
            raise CliError(f"--methods: unknown {', '.join(bad)} (known: {', '.join(METHODS)})")
        if args.warmup < 0 or args.repeat < 1:
            raise CliError("--warmup must be >= 0 and --repeat >= 1")
        if args.chunk_size is not None and args.chunk_size < 1:
            raise CliError(f"--chunk-size must be >= 1, got {args.chunk_size}")
        if not (math.isfinite(args.temperature) and args.temperature > 0):
            raise CliError(f"--temperature must be a finite number > 0, got {args.temperature}")
        if not torch.cuda.is_available():
            raise CliError("needs CUDA (this benchmark times GPU kernels)", EXIT_BLOCKED)
        from rlkernel import _ext

        if any("loss" in m and m != "loss-native" for m in methods) and _ext.unavailable_reason():
            raise CliError(f"--methods loss needs rlkernel._C: {_ext.unavailable_reason()} "
                           "(python -m rlkernel.env says why)", EXIT_BLOCKED)
    except CliError as exc:
        print(f"bench_linear_logp_loss: {exc}", file=sys.stderr)
        return exc.code
    os.environ["RLKERNEL_VALIDATE"] = "0"
    from rlkernel.ops.fused import epilogue_gemm

    dtype = getattr(torch, args.dtype)
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | {args.dtype} | median of {args.repeat} "
          f"(warmup {args.warmup})")
    # extra GB: the allocator's peak during one run minus what was allocated before it, less the gradients the run
    # returns (hidden's and weight's; the matmul's output is allocated before it): bench_linear_logp.py's measure
    print(f"{'shape NxHxV':>22} {'method':>12} {'ms':>9} {'x matmul':>9} {'TFLOP/s':>8} {'peak GiB':>9} "
          f"{'extra GB':>9}  command")
    for n, h, v in shapes:
        fns = make_methods(n, h, v, dtype, args)
        base_ms = None
        order = (["matmul"] if "matmul" in methods else []) + [m for m in methods if m != "matmul"]
        for m in order:
            cmd = (f"python benchmarks/bench_linear_logp_loss.py --shapes {n}x{h}x{v} --methods matmul,{m} "
                   f"--dtype {args.dtype} --repeat {args.repeat}")
            entry = fns[m]
            if isinstance(entry, str):
                print(f"{f'{n}x{h}x{v}':>22} {m:>12} {'-':>9} {'-':>9} {'-':>8} {'-':>9}  skipped: {entry}")
                continue
            fn, prep = entry
            epilogue_gemm.reset_records()
            try:
                ms = events_median(fn, prep, args.warmup, args.repeat)
                peak = peak_extra(fn, prep)
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                print(f"{f'{n}x{h}x{v}':>22} {m:>12} {'OOM':>9}  {cmd}")
                continue
            except Exception as exc:  # noqa: BLE001 - one method failing (a peer's API) must not hide the others
                print(f"{f'{n}x{h}x{v}':>22} {m:>12} {'error':>9}  {type(exc).__name__}: {str(exc)[:120]}")
                continue
            if m == "matmul":
                base_ms = ms
            gemms = 1 if m == "matmul" or m.startswith("fwd-") else 3
            grads = 0 if m == "matmul" or m.startswith("fwd-") else (n * h + v * h) * dtype.itemsize
            tflops = gemms * 2 * n * h * v / (ms * 1e-3) / 1e12
            ratio = f"{ms / base_ms:.2f}" if base_ms else "-"
            # the "-auto" rows: which forward ENABLED="auto" took, and why not the epilogue GEMM where it did not
            took = ("  took: " + "; ".join(f"{kernel} {why}".strip() for kernel, why in epilogue_gemm.records())
                    if m.endswith("-auto") else "")
            print(f"{f'{n}x{h}x{v}':>22} {m:>12} {ms:9.2f} {ratio:>9} {tflops:8.0f} {peak / 2 ** 30:9.2f} "
                  f"{(peak - grads) / 1e9:9.3f}  {cmd}{took}",
                  flush=True)
        del fns
        torch.cuda.empty_cache()
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
