r"""rlkernel.linear_logp (log-probs + entropy from hidden states and the LM head) against a bare cuBLAS matmul and its
peers, side by side on the same inputs in one run (issue 21).

    python benchmarks/bench_linear_logp.py                        # the issue's shapes (H200: a few minutes)
    python benchmarks/bench_linear_logp.py --shapes 16384x4096x128256 --repeat 30
    python benchmarks/bench_linear_logp.py --list-kernels          # the kernel names of one fused call (profiler)
    python benchmarks/bench_linear_logp.py --shapes 16384x896x151936 --logits-dtype bf16,float32 \
        --methods matmul,fwd,fwdbwd,torch-fwd,liger --weight-scale 6 --temperature 0.7 --repeat 5   # issue 36

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
Issue 31's options (not in the default set; --methods all-options runs them all; each row notes its ratio to the
plain fwd / fwdbwd row of the same run, the option's cost when used; "not used" is fwd / fwdbwd on this branch vs
on the base commit):
  opt-rowT-fwd, opt-rowT-fwdbwd       temperature as a per-row tensor (every row --temperature);
  opt-softcap-fwd, opt-softcap-fwdbwd softcap=--softcap (30, Gemma's final_logit_softcapping);
  opt-scale-fwd, opt-scale-fwdbwd     logit_scale=--logit-scale (0.0625, Cohere's);
  opt-outputs-fwd                     outputs=(entropy, log_sum_sq_probs, mean_logit, is_top1), no grad;
  opt-entropy-fwd                     token_ids=None, return_entropy=True: the entropy alone, no grad;
  opt-all-fwdbwd                      per-row temperature + softcap + logit_scale + all outputs.
  The error columns of these rows compare with float64 of the same transform (opt-entropy-fwd: entropy only).
  proc-SPEC-fwd, proc-SPEC-fwdbwd   linear_logp's processed mode (issue 39), SPEC one of
                topk50 (top_k=50), topk1024-topp (top_k=1024, top_p=0.9), topk50-minp (top_k=50, min_p=0.05),
                topp (top_p=0.9 alone), minp (min_p=0.05 alone); the ids are each row's argmax (kept), the error
                columns against float64 logits through rlkernel.logp's native processed code; the note gives the
                ratio to the plain fwd (targets <= 1.25x with top_k <= 1024, <= 2.2x top_p alone) and, for fwdbwd,
                the backward alone (fwdbwd - fwd) against the plain one's (target <= 1.1x). Not in the default set:
                --methods fwd,fwdbwd,proc-topk50-fwd,proc-topk50-fwdbwd,... (fwd and fwdbwd first, for the notes).
  fwdbwd-accin  fwdbwd with grad_accumulation="input" (dW summed in the weight's dtype, the behaviour before the
                option; fwdbwd itself runs the default "float32", and its note gives its ratio to this row: issue 31
                target <= 1.05x);
  fwd-mask, fwdbwd-mask   fwd / fwdbwd with mask= a CPU bool mask keeping the first half of the rows (no host
                sync; the kept rows compacted before the GEMMs): notes give the ratio to the unmasked row (issue 31
                target <= 0.55x).
--logits-dtype (comma-separated, default "bf16"): "bf16" is the default contract (logits in the inputs' dtype,
``logits_dtype=None``), "float32" ``logits_dtype=torch.float32``; every method that has the choice runs once per
value (rlkernel's methods; torch-* with float32 is PyTorch's float32 head, ``hidden.float() @ weight.float().T`` with
TF32 off). matmul and liger run once. float32 rows of fwd / fwdbwd note their ratio to the bf16-logit row (issue 36
targets: <= 1.15x forward, <= 1.10x forward + backward).
Error columns, on every row: the largest |logp - exact| and |entropy - exact| (nats) over the first --error-rows
tokens, exact = float64 from the same 16-bit inputs; matmul: log_softmax of its logits (what a bare bf16 head
gives); liger: logp = -its per-token loss at T = 1 (it has no temperature), no entropy. --weight-scale S draws
weight ~ N(0, S^2 / H), so a logit's std is about S (6 gives |z| up to ~30 at V ~ 150k, realistic for LM heads);
the timing does not depend on it.
Each time is the median of --repeat runs, each timed by its own pair of CUDA events, after --warmup runs; gradients
are reset outside the events. TFLOP/s counts 2NHV per GEMM's worth of model work (forward 1, forward+backward 3).
Peak extra memory: the allocator's peak during one run minus what was allocated before it, less the returned
gradients (hidden and weight) and the outputs. RLKERNEL_VALIDATE=0 while timing is not needed: nothing here syncs.
--epilogue (off / on / pingpong / cluster / tile / both / all, default off): rlkernel's fwd, fwdbwd, fwdbwd-dtacc and
bi-* methods with the epilogue GEMM (issue 37: ``rlkernel.ops.fused.epilogue_gemm.ENABLED``; its backward's gradient
epilogue, ``GRAD``, on): "on" its cooperative config (rows METHOD+epi), "pingpong" its ping-pong config
(``CONFIG = 1``, bf16; rows METHOD+epi-pp), "cluster" the cooperative one in 2 x 1 clusters (``CONFIG = 2``, bf16;
rows METHOD+epi-c2), "tile" the cooperative one with the gradient epilogue off (``GRAD = False``: the backward's
float32 tile and grad kernel; rows METHOD+epi-tile, backward methods only), "both" the cuBLAS path and "on", "all"
all five; a row whose call did not take the epilogue GEMM or its gradient epilogue says why in its note. Its ncu
profile (tensor pipe, SM and DRAM throughput), beside the cuBLAS path's:
    ncu --kernel-name regex:'rlkernel_linear_logp_epilogue|nvjet|gemm|rlkernel_linear_logp_fold' --launch-skip 3 \
        --launch-count 6 --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        python benchmarks/bench_linear_logp.py --shapes 16384x896x151936 --methods matmul,fwd --epilogue both \
        --repeat 1 --warmup 1
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
OPTION_METHODS = ["opt-rowT-fwd", "opt-rowT-fwdbwd", "opt-softcap-fwd", "opt-softcap-fwdbwd", "opt-scale-fwd",
                  "opt-scale-fwdbwd", "opt-outputs-fwd", "opt-entropy-fwd", "opt-all-fwdbwd"]
PROCESSED = {"topk50": dict(top_k=50), "topk1024-topp": dict(top_k=1024, top_p=0.9),
             "topk50-minp": dict(top_k=50, min_p=0.05), "topp": dict(top_p=0.9), "minp": dict(min_p=0.05)}
PROCESSED_METHODS = [f"proc-{spec}-{kind}" for spec in PROCESSED for kind in ("fwd", "fwdbwd")]
ALL_METHODS = (DEFAULT_METHODS + ["native-fwdbwd", "fwdbwd-accin", "fwd-mask", "fwdbwd-mask"]
               + OPTION_METHODS + PROCESSED_METHODS)
TEMPERATURE = 1.0  # --temperature sets it
SOFTCAP, LOGIT_SCALE = 30.0, 0.0625  # --softcap, --logit-scale set them
LOGITS_DTYPES = {"bf16": None, "default": None, "float32": torch.float32}
EPILOGUE_METHODS = ("fwd", "fwdbwd", "fwdbwd-dtacc", "bi-fwd", "bi-fwdbwd")  # --epilogue applies to these
EPILOGUE_CHOICES = {"off": (None,), "on": (0,), "pingpong": (1,), "cluster": (2,), "tile": ("tile",),
                    "both": (None, 0), "all": (None, 0, 1, 2, "tile")}
# None: the cuBLAS path; 0 / 1 / 2: the epilogue GEMM in that config; "tile": config 0 with its gradient epilogue
# off (the backward's float32 tile and grad kernel, as before it): (CONFIG, GRAD, row suffix, --epilogue value)
EPILOGUE_RUNS = {None: (0, True, "", "off"), 0: (0, True, "+epi", "on"), 1: (1, True, "+epi-pp", "pingpong"),
                 2: (2, True, "+epi-c2", "cluster"), "tile": (0, False, "+epi-tile", "tile")}
WITH_LOGITS_DTYPE = ("fwd", "fwdbwd", "fwdbwd-dtacc", "bi-fwd", "bi-fwdbwd", "torch-fwd", "torch-fwdbwd",
                     "native-fwdbwd", "fwdbwd-accin", "fwd-mask", "fwdbwd-mask", *OPTION_METHODS, *PROCESSED_METHODS)


class Case:
    """The inputs of one shape, shared by every method."""

    def __init__(self, n, h, v, dtype, seed=0, weight_scale=1.0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.n, self.h, self.v, self.dtype = n, h, v, dtype
        self.hidden = torch.randn(n, h, device="cuda", generator=g).to(dtype).requires_grad_(True)
        weight = torch.randn(v, h, device="cuda", generator=g) * weight_scale / h ** 0.5
        self.weight = weight.to(dtype).requires_grad_(True)
        self.ids = torch.randint(0, v, (n,), device="cuda", generator=g)
        self.gl = torch.randn(n, device="cuda", generator=g)
        self.gh = torch.randn(n, device="cuda", generator=g) * 0.01
        self.grad_bytes = (n * h + v * h) * self.hidden.element_size()

    def zero_grads(self):
        self.hidden.grad = None
        self.weight.grad = None

    def argmax_ids(self):
        """Each row's argmax (kept by every filter): the processed methods' ids, computed once (2048 rows at a time)."""
        if getattr(self, "_argmax", None) is None:
            with torch.no_grad():
                self._argmax = torch.cat([(self.hidden[r0:r0 + 2048] @ self.weight.t()).argmax(-1)
                                          for r0 in range(0, self.n, 2048)])
        return self._argmax

    def half_mask(self):
        """A CPU mask keeping the first half of the rows (padding at the end, as a packed batch has it; the error
        columns' first rows are kept)."""
        mask = torch.zeros(self.n, dtype=torch.bool)
        mask[: self.n // 2] = True
        return mask



def exact_processed(case, rows: int, temperature: float, filters: dict):
    """(logp, entropy) of the processed mode from float64 logits of the same 16-bit inputs (rlkernel.logp's native
    processed code in float64; 256 rows at a time), at the argmax ids."""
    import rlkernel

    c = case
    w = c.weight.detach().double()
    ids = c.argmax_ids()
    lps, ents = [], []
    with torch.no_grad():
        for r0 in range(0, min(rows, c.n), 256):
            r1 = min(rows, c.n, r0 + 256)
            logits = c.hidden[r0:r1].detach().double() @ w.t()
            lp, ent = rlkernel.logp(logits, ids[r0:r1], temperature=temperature, return_entropy=True,
                                    backend="native", **filters)
            lps.append(lp.double())
            ents.append(ent.double())
    return torch.cat(lps), torch.cat(ents)


def option_kwargs(name: str, case) -> tuple[dict, tuple]:
    """(linear_logp's option keywords of an opt-* method, the (scale, softcap) its exact values need)."""
    kw = {}
    if "rowT" in name or "all" in name:
        kw["temperature"] = torch.full((case.n,), TEMPERATURE, device="cuda")
    if "softcap" in name or "all" in name:
        kw["softcap"] = SOFTCAP
    if "scale" in name or "all" in name:
        kw["logit_scale"] = LOGIT_SCALE
    if "outputs" in name or "all" in name:
        kw["outputs"] = ("entropy", "log_sum_sq_probs", "mean_logit", "is_top1")
    return kw, (kw.get("logit_scale", 1.0), kw.get("softcap"))


def exact_values(case, rows: int, temperature: float, transform=(1.0, None)):
    """float64 (logp, entropy) of the first ``rows`` tokens from the same 16-bit inputs (256 rows at a time);
    ``transform``: (logit_scale, softcap) applied before the temperature."""
    scale, softcap = transform
    c = case
    w = c.weight.detach().double()
    lps, ents = [], []
    with torch.no_grad():
        for r0 in range(0, min(rows, c.n), 256):
            r1 = min(rows, c.n, r0 + 256)
            z = c.hidden[r0:r1].detach().double() @ w.t() * scale
            if softcap is not None:
                z = softcap * torch.tanh(z / softcap)
            lsm = torch.log_softmax(z / temperature, dim=-1)
            del z
            lps.append(lsm.gather(-1, c.ids[r0:r1, None])[:, 0])
            ents.append(-(lsm.exp() * lsm).sum(-1))
            del lsm
    del w
    return torch.cat(lps), torch.cat(ents)


def errors_vs_exact(out, exact, name):
    """(max |logp err|, max |entropy err| or None) of a run's output over the exact rows."""
    if name == "liger":
        if out.dim() == 0:
            return None, None  # a summed loss: no per-token values
        lp, ent = -out, None  # its per-token loss is -logp
    else:
        lp, ent = out[:2] if isinstance(out, tuple) else (out, None)
    rows = exact[0].shape[0]
    if lp is None:
        e_lp = None
    else:
        d = lp.detach()[:rows].double() - exact[0]
        d = d[~(torch.isinf(lp.detach()[:rows]) & (lp.detach()[:rows] == exact[0]))]  # processed: -inf off the kept set
        e_lp = d.abs().max().item() if d.numel() else 0.0
    e_ent = None if ent is None else (ent.detach()[:rows].double() - exact[1]).abs().max().item()
    return e_lp, e_ent


def _method(name, case, logits_dtype=None):
    """(run, prep, model GEMMs, bytes to subtract from the peak, skip reason or None); run returns the log-probs
    (and the entropies where the method has them)."""
    import rlkernel

    c = case
    nothing = lambda: None  # noqa: E731
    if name == "matmul":
        def run():
            with torch.no_grad():
                return c.hidden @ c.weight.t()

        def values():  # what a bare bf16 head's logits give: float32 log_softmax of them
            with torch.no_grad():
                lsm = torch.log_softmax(run().float() / TEMPERATURE, dim=-1)
                return lsm.gather(-1, c.ids[:, None])[:, 0], -(lsm.exp() * lsm).sum(-1)
        run.values = values
        return run, nothing, 1, 0, None
    if name in ("fwd", "bi-fwd", "fwd-mask"):
        bi = name == "bi-fwd"
        mask = c.half_mask() if name == "fwd-mask" else None

        def run():
            with torch.no_grad():
                return rlkernel.linear_logp(c.hidden, c.weight, c.ids, temperature=TEMPERATURE, return_entropy=True,
                                            batch_invariant=bi, backend="fused", logits_dtype=logits_dtype,
                                            mask=mask)
        return run, nothing, 1, 8 * c.n, None
    if name in ("fwdbwd", "bi-fwdbwd", "native-fwdbwd", "fwdbwd-dtacc", "fwdbwd-accin", "fwdbwd-mask"):
        from rlkernel.ops.fused import linear_logp as linear_logp_fused

        bi = name == "bi-fwdbwd"
        backend = "native" if name == "native-fwdbwd" else "fused"
        key = (c.hidden.device.index, c.dtype)
        dtype_acc = name == "fwdbwd-dtacc"
        accumulation = "input" if name == "fwdbwd-accin" else "float32"
        mask = c.half_mask() if name == "fwdbwd-mask" else None

        def run():
            saved = linear_logp_fused._dh_modes.get(key)
            if dtype_acc:
                linear_logp_fused._dh_modes[key] = "dtype"
            try:
                lp, ent = rlkernel.linear_logp(c.hidden, c.weight, c.ids, temperature=TEMPERATURE,
                                               return_entropy=True, batch_invariant=bi, backend=backend,
                                               logits_dtype=logits_dtype, grad_accumulation=accumulation,
                                               mask=mask)
                torch.autograd.backward([lp, ent], [c.gl, c.gh])
            finally:
                if dtype_acc:
                    if saved is None:
                        linear_logp_fused._dh_modes.pop(key, None)
                    else:
                        linear_logp_fused._dh_modes[key] = saved
            return lp.detach(), ent.detach()
        return run, c.zero_grads, 3, c.grad_bytes + 8 * c.n, None
    if name in ("torch-fwd", "torch-fwdbwd"):
        grad = name == "torch-fwdbwd"
        f32 = logits_dtype is not None
        # bf16 logits (float32 head: float32 copies of hidden and weight, float32 logits), float32 copy, log_softmax,
        # p, p*log p (+ grads)
        per_logit = (2 + 4 * 4) * (2 if grad else 1)
        need = c.n * c.v * per_logit + (4 * (c.n + c.v) * c.h if f32 else 0)
        free = torch.cuda.mem_get_info()[0]
        if need > 0.85 * free:
            return None, None, 0, 0, f"needs ~{need / 1e9:.0f} GB, {free / 1e9:.0f} GB free"

        def run():
            with torch.set_grad_enabled(grad):
                if f32:  # PyTorch's float32 head (TRL's cast_lm_head_to_fp32): upcast operands, TF32 off
                    tf32 = torch.backends.cuda.matmul.allow_tf32
                    torch.backends.cuda.matmul.allow_tf32 = False
                    try:
                        logits = c.hidden.float() @ c.weight.float().t()
                    finally:
                        torch.backends.cuda.matmul.allow_tf32 = tf32
                else:
                    logits = c.hidden @ c.weight.t()
                lsm = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)
                lp = lsm.gather(-1, c.ids[:, None])[:, 0]
                ent = -(lsm.exp() * lsm).sum(-1)
                if grad:
                    torch.autograd.backward([lp, ent], [c.gl, c.gh])
                return lp.detach(), ent.detach()
        return run, c.zero_grads, 3 if grad else 1, (c.grad_bytes if grad else 0) + 8 * c.n, None
    if name == "liger":
        return _liger(c)
    if name in OPTION_METHODS:
        return _option_method(name, c, logits_dtype)
    if name.startswith("proc-"):
        spec, kind = name[len("proc-"):].rsplit("-", 1)
        filters, grad = PROCESSED[spec], kind == "fwdbwd"
        ids = c.argmax_ids()

        def run():
            with torch.set_grad_enabled(grad):
                lp, ent = rlkernel.linear_logp(c.hidden, c.weight, ids, temperature=TEMPERATURE, return_entropy=True,
                                               backend="fused", logits_dtype=logits_dtype, **filters)
                if grad:
                    torch.autograd.backward([lp, ent], [c.gl, c.gh])
            return lp.detach(), ent.detach()
        return run, c.zero_grads, 3 if grad else 1, (c.grad_bytes if grad else 0) + 8 * c.n, None
    raise CliError(f"unknown method {name!r}")


def _option_method(name, c, logits_dtype):
    """An opt-* method: rlkernel.linear_logp with issue 31's options (backend "auto": the path the options take)."""
    import rlkernel

    kw, _ = option_kwargs(name, c)
    kw.setdefault("temperature", TEMPERATURE)
    if name == "opt-entropy-fwd":
        def run():
            with torch.no_grad():
                return None, rlkernel.linear_logp(c.hidden, c.weight, None, return_entropy=True,
                                                  logits_dtype=logits_dtype, **kw)
        return run, lambda: None, 1, 4 * c.n, None
    grad = name.endswith("fwdbwd")

    def run():
        with torch.set_grad_enabled(grad):
            out = rlkernel.linear_logp(c.hidden, c.weight, c.ids, return_entropy=True, logits_dtype=logits_dtype,
                                       **kw)
            lp, ent = out[0], out[1]
            if grad:
                torch.autograd.backward([lp, ent], [c.gl, c.gh])
            return lp.detach(), ent.detach()
    return run, c.zero_grads, 3 if grad else 1, (c.grad_bytes if grad else 0) + 8 * c.n, None


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


def _processed_note(name, lname, ms, times):
    """The processed method's ratio to the plain one (and, for fwdbwd, the backward alone against the plain's)."""
    spec, kind = name[len("proc-"):].rsplit("-", 1)
    plain = times.get((kind, lname))
    if plain is None:
        return "run fwd / fwdbwd first for the ratio"
    if kind == "fwd":
        target = "2.2x" if spec == "topp" or spec == "minp" else "1.25x"
        return f"{ms / plain:.3f}x plain fwd (target <= {target})"
    proc_fwd, plain_fwd = times.get((f"proc-{spec}-fwd", lname)), times.get(("fwd", lname))
    note = f"{ms / plain:.3f}x plain fwdbwd"
    if proc_fwd is not None and plain_fwd is not None and plain > plain_fwd:
        note += f"; bwd {(ms - proc_fwd) / (plain - plain_fwd):.3f}x plain bwd (target <= 1.1x)"
    return note


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
                   help=f"comma-separated, of: {', '.join(ALL_METHODS)}, all-options (matmul, fwd, fwdbwd, opt-*)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--repeat", type=int, default=20, help="timed runs per method (median)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--logits-dtype", default="bf16",
                   help="comma-separated, of: bf16 (the default contract), float32 (logits_dtype=torch.float32)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--softcap", type=float, default=30.0, help="the opt-*softcap* methods' softcap")
    p.add_argument("--logit-scale", type=float, default=0.0625, help="the opt-*scale* methods' logit_scale")
    p.add_argument("--weight-scale", type=float, default=1.0, help="weight ~ N(0, S^2 / H): logits of std ~S")
    p.add_argument("--error-rows", type=int, default=1024, help="tokens compared with float64 (error columns)")
    p.add_argument("--out", default=None, help="CSV path (default reports/bench_linear_logp-<UTC time>.csv)")
    p.add_argument("--list-kernels", action="store_true", help="print the kernels of one fused call and exit")
    p.add_argument("--epilogue", default="off", choices=list(EPILOGUE_CHOICES),
                   help="rlkernel's fwd/fwdbwd/bi-* methods with the epilogue GEMM (issue 37): off (default), on "
                        "(cooperative), pingpong, cluster, tile (cooperative, gradient epilogue off), both (off + on), "
                        "all")
    try:
        args = p.parse_args(argv)
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        if "all-options" in methods:  # the plain rows first: the options' ratios refer to them
            at = methods.index("all-options")
            methods[at:at + 1] = [m for m in ["matmul", "fwd", "fwdbwd", *OPTION_METHODS] if m not in methods]
        unknown = [m for m in methods if m not in ALL_METHODS]
        if unknown or not methods:
            raise CliError(f"--methods: unknown {unknown} (choose from {', '.join(ALL_METHODS)})")
        if args.repeat < 1 or args.warmup < 0:
            raise CliError("--repeat must be >= 1 and --warmup >= 0")
        logits_names = [x.strip() for x in args.logits_dtype.split(",") if x.strip()]
        bad = [x for x in logits_names if x not in LOGITS_DTYPES]
        if bad or not logits_names:
            raise CliError(f"--logits-dtype: unknown {bad} (choose from bf16, float32)")
        if not args.temperature > 0 or not args.weight_scale > 0 or args.error_rows < 1:
            raise CliError("--temperature and --weight-scale must be > 0, --error-rows >= 1")
        if not args.softcap > 0 or not args.logit_scale > 0:
            raise CliError("--softcap and --logit-scale must be > 0")
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
    from rlkernel.ops.fused import epilogue_gemm

    global TEMPERATURE, SOFTCAP, LOGIT_SCALE
    TEMPERATURE, SOFTCAP, LOGIT_SCALE = args.temperature, args.softcap, args.logit_scale
    dtype = getattr(torch, args.dtype)
    shapes = args.shapes or DEFAULT_SHAPES
    if args.list_kernels:
        _list_kernels(Case(*shapes[0], dtype, weight_scale=args.weight_scale))
        return 0
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or os.path.join("reports", f"bench_linear_logp-{stamp}.csv")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | cuda {torch.version.cuda} | {args.dtype} | "
          f"median of {args.repeat} | T {TEMPERATURE} | weight scale {args.weight_scale} | {stamp}")
    print(f"{'shape NxHxV':>20} {'method':>14} {'logits':>7} {'ms':>9} {'x matmul':>9} {'TFLOP/s':>8} "
          f"{'extra GB':>9} {'logp err':>9} {'ent err':>9}  note")
    rows = []
    fmt = lambda e: "-" if e is None else f"{e:.2e}"  # noqa: E731
    for n, h, v in shapes:
        case = Case(n, h, v, dtype, weight_scale=args.weight_scale)
        exact = {(TEMPERATURE, (1.0, None)): exact_values(case, args.error_rows, TEMPERATURE)}
        t_mm = None
        times = {}
        for name, lname, epi in [(m, ln, e) for m in methods
                                 for ln in (logits_names if m in WITH_LOGITS_DTYPE
                                            else [args.dtype.replace("bfloat16", "bf16")])
                                 for e in (EPILOGUE_CHOICES[args.epilogue] if m in EPILOGUE_METHODS else (None,))
                                 if e != "tile" or "bwd" in m]:  # GRAD only changes a backward
                config, grad, suffix, flag = EPILOGUE_RUNS[epi]
                epilogue_gemm.ENABLED, epilogue_gemm.CONFIG, epilogue_gemm.GRAD = epi is not None, config, grad
                epilogue_gemm.reset_records()
                label = name + suffix
                run, prep, gemms, subtract, note = _method(name, case, LOGITS_DTYPES.get(lname))
                shape_txt = f"{n}x{h}x{v}"
                cmd = (f"python benchmarks/bench_linear_logp.py --shapes {shape_txt} --methods matmul,{name} "
                       f"--dtype {args.dtype} --repeat {args.repeat} --logits-dtype {lname} "
                       f"--temperature {TEMPERATURE} --weight-scale {args.weight_scale}"
                       + ("" if epi is None else f" --epilogue {flag}"))
                blank = dict(shape=shape_txt, method=label, logits_dtype=lname, ms="", x_matmul="", tflops="",
                             extra_gb="", logp_err="", entropy_err="")
                if run is None:
                    print(f"{shape_txt:>20} {label:>14} {lname:>7} {'-':>9}  skipped: {note}")
                    rows.append(dict(blank, note=f"skipped: {note}", command=cmd))
                    continue
                try:
                    ms = events_median(run, prep, args.warmup, args.repeat)
                    extra = peak_extra(run, prep) - subtract
                    prep()
                    result = run.values() if hasattr(run, "values") else run()
                    t_ref = 1.0 if name == "liger" else TEMPERATURE
                    if name.startswith("proc-"):
                        key = (TEMPERATURE, name.rsplit("-", 1)[0])
                        if key not in exact:
                            exact[key] = exact_processed(case, args.error_rows, TEMPERATURE,
                                                         PROCESSED[key[1][len("proc-"):]])
                    else:
                        key = (t_ref, option_kwargs(name, case)[1] if name in OPTION_METHODS else (1.0, None))
                        if key not in exact:
                            exact[key] = exact_values(case, args.error_rows, *key)
                    e_lp, e_ent = errors_vs_exact(result, exact[key], name)
                    del result
                except torch.OutOfMemoryError:
                    case.zero_grads()
                    torch.cuda.empty_cache()
                    print(f"{shape_txt:>20} {label:>14} {lname:>7} {'oom':>9}")
                    rows.append(dict(blank, note="out of memory", command=cmd))
                    continue
                case.zero_grads()
                times[(label, lname)] = ms
                if name == "matmul":
                    t_mm = ms
                ratio = ms / t_mm if t_mm else float("nan")
                tflops = gemms * 2 * n * h * v / (ms * 1e-3) / 1e12
                note = {"fwd": "target <= 1.15x", "fwdbwd": "target <= 4.4x"}.get(name, note or "")
                if name.startswith("bi-") and (label[3:], lname) in times:
                    note = f"{ms / times[(label[3:], lname)]:.3f}x default mode (target <= 1.10x)"
                plain = "fwdbwd" if name.endswith("fwdbwd") else "fwd"  # the cuBLAS-path row (--epilogue off)
                if name in OPTION_METHODS and (plain, lname) in times:
                    note = f"{ms / times[(plain, lname)]:.3f}x {plain} (the option's cost when used)"
                if label == "fwdbwd" and ("fwdbwd-accin", lname) in times:
                    note = f"{ms / times[('fwdbwd-accin', lname)]:.3f}x grad_accumulation=input (target <= 1.05x)"
                if label == "fwdbwd-accin" and ("fwdbwd", lname) in times:
                    ratio32 = times[("fwdbwd", lname)] / ms
                    note = f"fwdbwd (float32 accumulation) is {ratio32:.3f}x this (target <= 1.05x)"
                if label.endswith("-mask") and (label[:-5], lname) in times:
                    note = f"{ms / times[(label[:-5], lname)]:.3f}x unmasked, half the rows masked (target <= 0.55x)"
                if lname == "float32" and (label, "bf16") in times and name in ("fwd", "fwdbwd"):
                    target = "1.15x" if name == "fwd" else "1.10x"
                    note = f"{ms / times[(label, 'bf16')]:.3f}x bf16 logits (target <= {target})"
                if epi is not None and (name, lname) in times:
                    note = f"{ms / times[(name, lname)]:.3f}x the cuBLAS path; {note}"
                missed = sorted({why for (kernel, why) in epilogue_gemm.records() if kernel == "cublas"})
                if epi is not None and missed:
                    note = f"epilogue GEMM not taken: {'; '.join(missed)}; {note}"
                grad_missed = sorted({why for (kernel, why) in epilogue_gemm.grad_records() if kernel == "tile"})
                if epi is not None and grad and grad_missed:
                    note = f"gradient epilogue not taken: {'; '.join(grad_missed)}; {note}"
                if name.startswith("proc-"):
                    note = _processed_note(name, lname, ms, times)
                if name == "liger" and note == "sum":
                    note = "reduction=sum (per-token output unsupported by this version)"
                print(f"{shape_txt:>20} {label:>14} {lname:>7} {ms:9.2f} {ratio:9.3f} {tflops:8.1f} {extra / 1e9:9.3f} "
                      f"{fmt(e_lp):>9} {fmt(e_ent):>9}  {note}")
                rows.append(dict(blank, ms=f"{ms:.4f}", x_matmul=f"{ratio:.4f}", tflops=f"{tflops:.1f}",
                                 extra_gb=f"{extra / 1e9:.4f}", logp_err=fmt(e_lp), entropy_err=fmt(e_ent),
                                 note=note, command=cmd))
        epilogue_gemm.ENABLED, epilogue_gemm.CONFIG, epilogue_gemm.GRAD = False, 0, True
        del case, exact
        torch.cuda.empty_cache()
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"# wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
