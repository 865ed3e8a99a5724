"""rlkernel.linear_logp (log-probs + entropy from hidden states and the LM head) against a bare cuBLAS matmul and its
peers, side by side on the same inputs in one run (issue 21).

    python benchmarks/bench_linear_logp.py                        # the issue's shapes (H200: a few minutes)
    python benchmarks/bench_linear_logp.py --shapes 16384x4096x128256 --repeat 30
    python benchmarks/bench_linear_logp.py --list-kernels          # the kernel names of one fused call (profiler)

Shapes are NxHxV (tokens x hidden x vocabulary). Default: 16384x4096x128256 first, then one dimension varied at a
time: N in {4096, 32768}, H in {896, 8192}, V in {32000, 151936}. Methods (--methods, comma-separated):
  matmul        bare ``hidden @ weight.T`` (cuBLAS, the inputs' dtype): the yardstick of every ratio;
  fwd           rlkernel.linear_logp forward, log-probs + entropy, no grad (target <= 1.15x matmul);
  fwdbwd        the same with autograd, backward to hidden and weight (target <= 4.4x matmul);
  fwdbwd-dtacc  fwdbwd with the hidden-state gradient summed in the inputs' dtype instead of a float32 accumulator
                (what runs where aten cannot give a bf16/fp16 GEMM a float32 output: dh_accumulation "dtype");
  bi-fwd, bi-fwdbwd   the same with batch_invariant=True (target: <= 1.10x the default mode);
  torch-fwd, torch-fwdbwd   plain PyTorch: matmul, float32 log_softmax, gather, entropy (skipped when its
                estimated memory does not fit);
  liger         Liger-Kernel's fused linear cross-entropy (per-token losses when its version allows, else a summed
                loss), which computes its gradients in the forward: timed forward + backward;
  native-fwdbwd rlkernel's own native backend (chunked PyTorch; not in the default set).
Each time is the median of --repeat runs, each timed by its own pair of CUDA events, after --warmup runs; gradients
are reset outside the events. TFLOP/s counts 2NHV per GEMM's worth of model work (forward 1, forward+backward 3).
Peak extra memory: the allocator's peak during one run minus what was allocated before it, less the returned
gradients (hidden and weight) and the outputs. RLKERNEL_VALIDATE=0 while timing is not needed: nothing here syncs.
Writes a CSV (--out, default reports/bench_linear_logp-<UTC time>.csv). Exit codes: 0 done, 2 bad arguments,
3 no CUDA / extension not built.
"""
from __future__ import annotations

import csv
import datetime as dt
import os
import sys

import torch
from _timing import events_median, parse_nhv, peak_extra  # beside this script: on sys.path when it runs

from rlkernel.cli import CliError, OneLineParser

DEFAULT_SHAPES = [(16384, 4096, 128256), (4096, 4096, 128256), (32768, 4096, 128256), (16384, 896, 128256),
                  (16384, 8192, 128256), (16384, 4096, 32000), (16384, 4096, 151936)]
DEFAULT_METHODS = ["matmul", "fwd", "fwdbwd", "fwdbwd-dtacc", "bi-fwd", "bi-fwdbwd", "torch-fwd", "torch-fwdbwd",
                   "liger"]
ALL_METHODS = DEFAULT_METHODS + ["native-fwdbwd"]
TEMPERATURE = 1.0


class Case:
    """The inputs of one shape, shared by every method."""

    def __init__(self, n, h, v, dtype, seed=0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.n, self.h, self.v, self.dtype = n, h, v, dtype
        self.hidden = torch.randn(n, h, device="cuda", generator=g).to(dtype).requires_grad_(True)
        self.weight = (torch.randn(v, h, device="cuda", generator=g) / h ** 0.5).to(dtype).requires_grad_(True)
        self.ids = torch.randint(0, v, (n,), device="cuda", generator=g)
        self.gl = torch.randn(n, device="cuda", generator=g)
        self.gh = torch.randn(n, device="cuda", generator=g) * 0.01
        self.grad_bytes = (n * h + v * h) * self.hidden.element_size()

    def zero_grads(self):
        self.hidden.grad = None
        self.weight.grad = None


def _method(name, case):
    """(run, prep, model GEMMs, bytes to subtract from the peak, skip reason or None)."""
    import rlkernel

    c = case
    nothing = lambda: None  # noqa: E731
    if name == "matmul":
        def run():
            with torch.no_grad():
                return c.hidden @ c.weight.t()
        return run, nothing, 1, 0, None
    if name in ("fwd", "bi-fwd"):
        bi = name == "bi-fwd"

        def run():
            with torch.no_grad():
                return rlkernel.linear_logp(c.hidden, c.weight, c.ids, temperature=TEMPERATURE, return_entropy=True,
                                            batch_invariant=bi, backend="fused")
        return run, nothing, 1, 8 * c.n, None
    if name in ("fwdbwd", "bi-fwdbwd", "native-fwdbwd", "fwdbwd-dtacc"):
        from rlkernel.ops.fused import linear_logp as linear_logp_fused

        bi = name == "bi-fwdbwd"
        backend = "native" if name == "native-fwdbwd" else "fused"
        key = (c.hidden.device.index, c.dtype)
        dtype_acc = name == "fwdbwd-dtacc"

        def run():
            saved = linear_logp_fused._dh_modes.get(key)
            if dtype_acc:
                linear_logp_fused._dh_modes[key] = "dtype"
            try:
                lp, ent = rlkernel.linear_logp(c.hidden, c.weight, c.ids, temperature=TEMPERATURE,
                                               return_entropy=True, batch_invariant=bi, backend=backend)
                torch.autograd.backward([lp, ent], [c.gl, c.gh])
            finally:
                if dtype_acc:
                    if saved is None:
                        linear_logp_fused._dh_modes.pop(key, None)
                    else:
                        linear_logp_fused._dh_modes[key] = saved
            return lp
        return run, c.zero_grads, 3, c.grad_bytes + 8 * c.n, None
    if name in ("torch-fwd", "torch-fwdbwd"):
        grad = name == "torch-fwdbwd"
        per_logit = (2 + 4 * 4) * (2 if grad else 1)  # bf16 logits, float32 copy, log_softmax, p, p*log p (+ grads)
        need = c.n * c.v * per_logit
        free = torch.cuda.mem_get_info()[0]
        if need > 0.85 * free:
            return None, None, 0, 0, f"needs ~{need / 1e9:.0f} GB, {free / 1e9:.0f} GB free"

        def run():
            with torch.set_grad_enabled(grad):
                logits = c.hidden @ c.weight.t()
                lsm = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)
                lp = lsm.gather(-1, c.ids[:, None])[:, 0]
                ent = -(lsm.exp() * lsm).sum(-1)
                if grad:
                    torch.autograd.backward([lp, ent], [c.gl, c.gh])
                return lp
        return run, c.zero_grads, 3 if grad else 1, (c.grad_bytes if grad else 0) + 4 * c.n, None
    if name == "liger":
        return _liger(c)
    raise CliError(f"unknown method {name!r}")


def _liger(c):
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError as exc:
        return None, None, 0, 0, f"liger_kernel not importable ({exc})"
    per_token = LigerFusedLinearCrossEntropyLoss(reduction="none")
    summed = LigerFusedLinearCrossEntropyLoss(reduction="sum")

    def run_none():
        loss = per_token(c.weight, c.hidden, c.ids)
        loss.backward(c.gl)
        return loss

    def run_sum():
        loss = summed(c.weight, c.hidden, c.ids)
        loss.backward()
        return loss

    try:  # per-token output first (what linear_logp returns); some versions only support a reduced loss
        c.zero_grads()
        run_none()
        torch.cuda.synchronize()
        run, label = run_none, None
    except Exception as exc:  # noqa: BLE001 (a third-party version difference: say what happened, use the sum)
        print(f"  liger reduction='none' failed ({type(exc).__name__}: {str(exc)[:80]}); timing reduction='sum'")
        run, label = run_sum, "sum"
    c.zero_grads()
    return run, c.zero_grads, 3, c.grad_bytes + 4 * c.n, label


def _list_kernels(case):
    from torch.profiler import ProfilerActivity, profile

    import rlkernel

    c = case
    bias = (torch.randn(c.v, device="cuda") * 0.1).to(c.dtype).requires_grad_(True)
    from rlkernel.ops.fused import linear_logp as linear_logp_fused

    for bi, b, epilogue in ((False, None, True), (True, None, True), (False, bias, True), (False, bias, False)):
        linear_logp_fused.BIAS_EPILOGUE = epilogue
        c.zero_grads()
        rlkernel.linear_logp(c.hidden, c.weight, c.ids, bias=b, batch_invariant=bi).sum().backward()  # warm-up
        c.zero_grads()
        bias.grad = None  # no accumulation kernel of autograd's in the listing
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            lp, ent = rlkernel.linear_logp(c.hidden, c.weight, c.ids, bias=b, return_entropy=True,
                                           batch_invariant=bi, backend="fused")
            torch.autograd.backward([lp, ent], [c.gl, c.gh])
            torch.cuda.synchronize()
        names = sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
        print(f"kernels of one fused forward+backward (batch_invariant={bi}, bias={b is not None}"
              f"{'' if b is None else f', BIAS_EPILOGUE={epilogue}'}), {c.n}x{c.h}x{c.v} {c.dtype}:")
        for name in names:
            print("   ", name[:160])
    linear_logp_fused.BIAS_EPILOGUE = True


def main(argv=None) -> int:
    p = OneLineParser(description=__doc__, formatter_class=__import__("argparse").RawTextHelpFormatter)
    p.add_argument("--shapes", nargs="+", type=parse_nhv, default=None, help="NxHxV ... (default: the issue's shapes)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma-separated, of: {', '.join(ALL_METHODS)}")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--repeat", type=int, default=20, help="timed runs per method (median)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None, help="CSV path (default reports/bench_linear_logp-<UTC time>.csv)")
    p.add_argument("--list-kernels", action="store_true", help="print the kernels of one fused call and exit")
    try:
        args = p.parse_args(argv)
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = [m for m in methods if m not in ALL_METHODS]
        if unknown or not methods:
            raise CliError(f"--methods: unknown {unknown} (choose from {', '.join(ALL_METHODS)})")
        if args.repeat < 1 or args.warmup < 0:
            raise CliError("--repeat must be >= 1 and --warmup >= 0")
    except CliError as exc:
        print(f"bench_linear_logp: {exc}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_linear_logp: needs a CUDA GPU", file=sys.stderr)
        return 3
    from rlkernel import _ext

    if _ext.unavailable_reason():
        print(f"bench_linear_logp: {_ext.unavailable_reason()} (python -m rlkernel.env says why)", file=sys.stderr)
        return 3
    dtype = getattr(torch, args.dtype)
    shapes = args.shapes or DEFAULT_SHAPES
    if args.list_kernels:
        _list_kernels(Case(*shapes[0], dtype))
        return 0
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or os.path.join("reports", f"bench_linear_logp-{stamp}.csv")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | cuda {torch.version.cuda} | {args.dtype} | "
          f"median of {args.repeat} | {stamp}")
    print(f"{'shape NxHxV':>20} {'method':>14} {'ms':>9} {'x matmul':>9} {'TFLOP/s':>8} {'extra GB':>9}  note")
    rows = []
    for n, h, v in shapes:
        case = Case(n, h, v, dtype)
        t_mm = None
        times = {}
        for name in methods:
            run, prep, gemms, subtract, note = _method(name, case)
            shape_txt = f"{n}x{h}x{v}"
            cmd = (f"python benchmarks/bench_linear_logp.py --shapes {shape_txt} --methods matmul,{name} "
                   f"--dtype {args.dtype} --repeat {args.repeat}")
            if run is None:
                print(f"{shape_txt:>20} {name:>14} {'-':>9} {'':>9} {'':>8} {'':>9}  skipped: {note}")
                rows.append(dict(shape=shape_txt, method=name, ms="", x_matmul="", tflops="", extra_gb="",
                                 note=f"skipped: {note}", command=cmd))
                continue
            try:
                ms = events_median(run, prep, args.warmup, args.repeat)
                extra = peak_extra(run, prep) - subtract
            except torch.OutOfMemoryError:
                case.zero_grads()
                torch.cuda.empty_cache()
                print(f"{shape_txt:>20} {name:>14} {'oom':>9}")
                rows.append(dict(shape=shape_txt, method=name, ms="", x_matmul="", tflops="", extra_gb="",
                                 note="out of memory", command=cmd))
                continue
            case.zero_grads()
            times[name] = ms
            if name == "matmul":
                t_mm = ms
            ratio = ms / t_mm if t_mm else float("nan")
            tflops = gemms * 2 * n * h * v / (ms * 1e-3) / 1e12
            note = {"fwd": "target <= 1.15x", "fwdbwd": "target <= 4.4x"}.get(name, note or "")
            if name.startswith("bi-") and name[3:] in times:
                note = f"{ms / times[name[3:]]:.3f}x default mode (target <= 1.10x)"
            if name == "liger" and note == "sum":
                note = "reduction=sum (per-token output unsupported by this version)"
            print(f"{shape_txt:>20} {name:>14} {ms:9.2f} {ratio:9.3f} {tflops:8.1f} {extra / 1e9:9.3f}  {note}")
            rows.append(dict(shape=shape_txt, method=name, ms=f"{ms:.4f}", x_matmul=f"{ratio:.4f}",
                             tflops=f"{tflops:.1f}", extra_gb=f"{extra / 1e9:.4f}", note=note, command=cmd))
        del case
        torch.cuda.empty_cache()
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"# wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
