"""The two passes of rlkernel.linear_logp_loss over token chunks: fused (cuBLAS GEMMs around the project's logp
kernels) and native (the same chunking in PyTorch). Each returns (loss, (d hidden, d weight, d bias)).

Per chunk, two ``op.linear_logp_loss`` NVTX ranges hold the op's own work: logits + log-probs/entropy before
``loss_fn``, the logits' gradient + dH/dW (+ a bias gradient's gemv) after it. ``loss_fn`` and its autograd are the
caller's code and run between them (docs/contracts.md, section 3), as does the reduction of its losses.
Input preparation (a strided hidden's copy, ids as int64, the ignore mask) runs before the first range.

Float32 logits (``Spec.logits32``, 16-bit inputs): fused, the [chunk, V] buffer is float32, written by aten's
float32-output GEMM (``blas.float32_logits``), the logp kernels run on it as float32 logits and write the float32
gradient over it, which ``rlkernel_linear_logp_cast_kernel`` rounds once into a 16-bit [chunk, V] buffer for the dH /
dW / db GEMMs (16-bit operands, float32 accumulation); native, the chunk's linear runs on float32 copies of
hidden's chunk, weight and bias (float32 leaves: float32 gradient GEMMs, dW summed in float32, no rounding of the
gradient before the output).

With the epilogue GEMM (``rlkernel.ops.fused.epilogue_gemm.ENABLED``) the fused forward writes no logits (float32
logits folded in the GEMM's epilogue), and where ``epilogue_gemm.grad_reason`` allows the backward's recompute GEMM
writes the 16-bit gradient straight into that buffer: no float32 [chunk, V] buffer, no logp backward and no cast.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from rlkernel import errors
from rlkernel.nvtx_ranges import op_range
from rlkernel.ops import precision
from rlkernel.ops.blas import float32_logits, float32_output_gemm
from rlkernel.ops.fused import epilogue_gemm
from rlkernel.ops.fused import linear_logp_options as fused_options
from rlkernel.ops.linear_options import TEMPERATURE_CODE, Options
from rlkernel.ops.native.softmax import compute_dtype
from rlkernel.ops.rows import flat_ids

OP = "linear_logp_loss"
RANGE = "op.linear_logp_loss"


@dataclasses.dataclass(frozen=True)
class Spec:
    loss_fn: Callable
    temperature: float  # the fused pass's (``opts`` None); the native pass takes opts.temperature
    ignore_index: int
    mean: bool
    ids_shape: torch.Size
    chunk: int
    logits32: bool = False
    opts: Options | None = None  # per-row temperature, softcap, logit_scale (rlkernel.ops.linear_options): native
    rows: fused_options.RowsOptions | None = None  # the fused pass's per-row temperature / softcap (option kernels)
    compute: torch.dtype | None = None  # the GEMMs' dtype (rlkernel.ops.precision); None: hidden's
    accumulation: str = "float32"  # grad_accumulation of dW / db
    autocast: tuple | None = None  # the caller's autocast, re-entered for loss_fn

    def options(self) -> Options:
        return self.opts if self.opts is not None else Options(self.temperature)


def _prepare(hidden: torch.Tensor, token_ids: torch.Tensor):
    """hidden as rows [N, H] with a unit last stride, flat int64 ids."""
    h = hidden.reshape(-1, hidden.shape[-1])
    if h.shape[1] > 1 and h.stride(1) != 1:
        h = h.contiguous()
    return h, flat_ids(token_ids)


def check_loss_output(out, lp) -> None:
    """loss_fn's result must be the chunk's per-token losses: a tensor of lp's shape (a scalar or a [c, 1] would
    broadcast into a silently scaled loss)."""
    if not isinstance(out, torch.Tensor) or out.shape != lp.shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"loss_fn must return the chunk's per-token losses, shape {tuple(lp.shape)}, got {got}")


def _apply_loss(spec: Spec, logp, entropy, sl: slice, keep, denom, need_grad: bool):
    """loss_fn on one chunk, outside the op's ranges: (the chunk's reduced loss, d/dlogp, d/dentropy)."""
    with torch.enable_grad():
        lp = logp.detach().requires_grad_(need_grad)
        en = entropy.detach().requires_grad_(need_grad)
        with precision.caller_autocast(spec.autocast):
            out = spec.loss_fn(lp, en, sl)
        check_loss_output(out, lp)
        # where, not a product: an ignored row's loss (whatever loss_fn makes of logp 0) is left out, NaN included
        total = torch.where(keep, out, torch.zeros((), dtype=out.dtype, device=out.device)).sum()
        if denom is not None:
            total = total / denom
        g_lp = g_en = None
        if need_grad and total.requires_grad:
            g_lp, g_en = torch.autograd.grad(total, (lp, en), allow_unused=True)
    if need_grad and g_lp is None and g_en is None:  # the loss does not depend on them: zero gradient
        g_lp = torch.zeros_like(logp)
    return total.detach(), g_lp, g_en


def _setup(hidden, weight, bias, token_ids, spec: Spec, needs, acc_dtype, loss_dtype, zeroed: bool):
    """Rows (in the compute dtype), ids, the kept-row mask, the mean's divisor, and the gradient buffers (dH in the
    compute dtype, dW, db in ``acc_dtype``; ``zeroed``: the pass adds into them from the first chunk on)."""
    h, ids = _prepare(hidden, token_ids)
    h = precision.cast(h.detach(), spec.compute or h.dtype)
    n, vocab = h.shape[0], weight.shape[0]
    need_h, need_w, need_b = needs[0], needs[1], bias is not None and needs[2]
    keep = ids != spec.ignore_index
    denom = keep.sum().clamp_min(1).to(loss_dtype) if spec.mean else None
    new = torch.zeros if zeroed or n == 0 else torch.empty  # no chunk at all: the gradient is 0
    dh = torch.empty(h.shape, dtype=h.dtype, device=h.device) if need_h else None
    dw = new(weight.shape, dtype=acc_dtype, device=h.device) if need_w else None
    db = new((vocab,), dtype=acc_dtype, device=h.device) if need_b else None
    return h, ids, keep, denom, dh, dw, db, (need_h, need_w, need_b)


def _result(total, hidden, weight, bias, dh, dw, db):
    """The loss and the gradients in their inputs' own dtypes."""
    dh = dh.view(hidden.shape).to(hidden.dtype) if dh is not None else None
    dw = dw.to(weight.dtype) if dw is not None else None
    db = db.to(bias.dtype) if db is not None else None
    return total, (dh, dw, db)


def _accumulator(weight, spec: Spec, compute, n: int):
    return precision.accumulation_dtype(weight.dtype, compute, spec.accumulation, -(-n // max(1, spec.chunk)))


def fused_pass(hidden, weight, bias, token_ids, spec: Spec, needs):
    """cuBLAS GEMMs and the fused logp kernels; the logits' gradient overwrites the logits buffer (no N x V). With
    the epilogue GEMM (``epilogue_gemm.ENABLED``) the forward writes no logits, and where ``grad_reason`` allows the
    backward's GEMM epilogue writes the 16-bit gradient straight into the gradient buffer."""
    from rlkernel.ops.fused import logp as fused_logp
    from rlkernel.ops.fused.linear_logp import _accumulate_w, dh_accumulation

    forward, backward = fused_logp.forward_op(), torch.ops.rlkernel.logp_backward_inplace
    cd = spec.compute or hidden.dtype
    acc = _accumulator(weight, spec, cd, math.prod(hidden.shape[:-1]))
    stored_w, stored_b = weight, bias
    with torch.no_grad():  # the GEMM operands in the compute dtype, before any op range (torch's cast kernels)
        weight, bias = precision.cast(weight, cd), precision.cast(bias, cd, contiguous=True)
    h, ids, keep, denom, dh, dw, db, (need_h, need_w, need_b) = _setup(hidden, weight, bias, token_ids, spec,
                                                                         needs, acc, torch.float32, False)
    n, vocab = h.shape[0], weight.shape[0]
    # float32 dW / db of 16-bit operands: the GEMMs sum into float32 (dh_accumulation's probe says how)
    acc_mode = dh_accumulation(h.device, h.dtype) if acc != h.dtype and (need_w or need_b) else None
    tmp_w = tmp_b = None
    if acc_mode in ("dtype", "mm+add") and n > spec.chunk:  # more than one chunk: a product buffer
        tmp_dtype = h.dtype if acc_mode == "dtype" else torch.float32
        tmp_w = torch.empty(weight.numel(), dtype=tmp_dtype, device=h.device) if need_w else None
        tmp_b = torch.empty(vocab, dtype=tmp_dtype, device=h.device) if need_b else None
    need_grad = need_h or need_w or need_b
    c = max(1, min(spec.chunk, n))
    # the epilogue GEMM's forward (float32 logits, no logits buffer); with a gradient the backward range recomputes
    # the chunk's float32 logits (the float32-logits backward: its softmax is the forward's), in the gradient
    # epilogue's GEMM where it runs
    rows_opt = spec.rows
    # the gradient epilogue's verdict first (None: it runs, or a float32 input, which the forward's reason names):
    # where it cannot run, a backward after the epilogue forward would recompute the logits this path keeps. Asked
    # with or without a gradient, so that under "auto" a call takes the same forward either way
    gwhy = (epilogue_gemm.grad_reason(h, weight, bias, False, False, rows_opt)
            if n and h.dtype != torch.float32 else None)
    why = ("n = 0" if not n else "per-row temperature / softcap (the option kernels)" if rows_opt is not None
           else epilogue_gemm.reason(h, weight, bias, False, need_grad, logits32=spec.logits32,
                                     adds_recompute=gwhy is not None))
    epilogue_gemm.record("cublas" if why else "epilogue", why or "")
    epilogue = why is None
    logits32 = spec.logits32 or epilogue
    bias_mode = None
    if logits32:
        reason, bias_mode = float32_output_gemm(h.device, h.dtype)
        if reason is not None:  # blas.float32_fallback records this as a fallback before the fused path is chosen
            raise RuntimeError(f"{OP}: float32 logits unavailable: {reason}")
    # the backward's gradient epilogue: the 16-bit gradient straight from the recompute's accumulator
    grad_epi = False
    if need_grad and n and logits32 and h.dtype != torch.float32:
        epilogue_gemm.record_grad("tile" if gwhy else "epilogue", gwhy or "")
        grad_epi = gwhy is None
    # the workspace (none for the epilogue GEMMs)
    buf = torch.empty((c if (need_grad and not grad_epi) or not epilogue else 0, vocab),
                      dtype=torch.float32 if logits32 else h.dtype, device=h.device)
    # float32 logits: their gradient rounded once to the inputs' dtype, the operand of the dH / dW / db GEMMs
    gbuf = torch.empty((c, vocab), dtype=h.dtype, device=h.device) if logits32 and need_grad else None
    ones = torch.ones((c,), dtype=h.dtype, device=h.device) if need_b else None
    state = torch.empty(4 * c, dtype=torch.float32, device=h.device) if rows_opt is not None else None
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    wt = weight.t()
    for s in range(0, n, c):
        e = min(n, s + c)
        hc, idc, logits = h[s:e], ids[s:e], buf[:e - s]
        address, seq, sync = errors.begin(OP, h.device, spec.ids_shape, vocab, offset=s)
        with op_range(RANGE):
            if epilogue:
                logp, ent, stats = epilogue_gemm.forward(hc, weight, bias, idc, spec.temperature, spec.ignore_index,
                                                         True, address, seq)
            else:
                _chunk_logits(hc, wt, bias, logits, bias_mode)
                if rows_opt is not None:
                    logp, ent, stats = _fold_rows(rows_opt, logits, idc, s, state, spec.ignore_index, address, seq)
                else:
                    with torch._C._AutoDispatchBelowAutograd():
                        logp, ent, stats = forward(logits, idc, spec.temperature, spec.ignore_index, True, address,
                                                   seq, errors.ERR_LOGP_BAD_ID, False, "fused")
        loss, g_lp, g_en = _apply_loss(spec, logp, ent, slice(s, e), keep[s:e], denom, need_grad)
        total.add_(loss)
        if need_grad:
            with op_range(RANGE):
                if grad_epi:  # G of the recomputed float32 logits, rounded once, from the GEMM's epilogue
                    logits = gbuf[:e - s]
                    epilogue_gemm.grad_tile(hc, weight, bias, idc, stats, g_lp, g_en, ent, 0, vocab,
                                            spec.temperature, spec.ignore_index, logits)
                else:
                    if epilogue:  # the recompute: the float32 logits whose softmax the forward folded
                        _chunk_logits(hc, wt, bias, logits, bias_mode)
                    if rows_opt is not None:  # logits := G, through the softcap the forward applied to them
                        fused_options.grad(rows_opt, logits, e - s, idc, s, e, stats, g_lp, g_en, ent, 0, vocab,
                                           spec.ignore_index, capped=True)
                    else:  # logits := G
                        backward(g_lp, g_en, logits, idc, stats, ent, spec.temperature, spec.ignore_index)
                    if gbuf is not None:
                        torch.ops.rlkernel.linear_logp_cast(logits, gbuf[:e - s])
                        logits = gbuf[:e - s]
                if need_h:
                    torch.mm(logits, weight, out=dh[s:e])
                if need_w and acc_mode is not None:
                    _accumulate_w(dw, logits.t(), hc, s == 0, acc_mode, tmp_w)
                elif need_w:
                    if s == 0:  # the first chunk writes dW: no fill kernel
                        torch.mm(logits.t(), hc, out=dw)
                    else:
                        dw.addmm_(logits.t(), hc)
                if need_b and acc_mode is not None:  # a [1, c] x [c, V] GEMM: float32 output, as dW's
                    _accumulate_w(db[None], ones[None, :e - s], logits, s == 0, acc_mode, tmp_b)
                elif need_b:
                    if s == 0:
                        torch.mv(logits.t(), ones[:e - s], out=db)
                    else:
                        db.addmv_(logits.t(), ones[:e - s])
        errors.after_call(h.device, sync)
    return _result(total, hidden, stored_w, stored_b, dh, dw, db)


def _fold_rows(opt, logits, ids, s: int, state, ignore_index: int, address: int, seq: int):
    """(logp, entropy, stats) of one chunk's [c, V] logits by the option kernels (a per-row temperature from
    ``opt.row_t[s:]``, the softcap applied in place first): the whole vocabulary as the fold's one chunk; error
    positions from 0 (the chunk's ``errors.begin`` has its offset)."""
    k, vocab = logits.shape
    f32 = dict(dtype=torch.float32, device=logits.device)
    logp, ent, stats = torch.empty(k, **f32), torch.empty(k, **f32), torch.empty(k, 2, **f32)
    fused_options.fold(opt, logits, ids, s, s + k, state[: 4 * k], logp, ent, stats, 0, vocab, ignore_index, True,
                       True, address, seq, row0=0)
    return logp, ent, stats


def _chunk_logits(hc, wt, bias, logits, bias_mode):
    """logits = hc @ wt (+ bias): float32 by ``blas.float32_logits`` where ``bias_mode`` is set, else the dtype's."""
    if bias_mode is not None:
        float32_logits(hc, wt, bias, logits, bias_mode)
    elif bias is None:
        torch.mm(hc, wt, out=logits)
    else:
        torch.addmm(bias, hc, wt, out=logits)


def _native_logp(logits, safe, valid, bad, opts: Options, s: int, e: int, cdtype):
    """Float32 (float64) log-probs and entropy of rows s..e, differentiable (through the transform too); ignored
    rows 0, bad rows NaN."""
    x, _ = opts.apply(logits.to(cdtype), s, e)
    logp_all = torch.log_softmax(x, dim=-1)
    p = logp_all.exp()
    # p log p is 0 where p is 0; the where keeps -inf out of the product and of its gradient
    ent = -(p * torch.where(p > 0, logp_all, torch.zeros((), dtype=cdtype, device=x.device))).sum(-1)
    tgt = logp_all.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    zero = torch.zeros((), dtype=cdtype, device=x.device)
    nan = torch.full((), float("nan"), dtype=cdtype, device=x.device)
    logp = torch.where(bad, nan, torch.where(valid, tgt, zero))
    ent = torch.where(bad, nan, torch.where(valid, ent, zero))
    return logp, ent


def native_pass(hidden, weight, bias, token_ids, spec: Spec, needs):
    """The same chunking in PyTorch: float32 softmax of one chunk, autograd of that chunk for its gradients."""
    gd = spec.compute or hidden.dtype
    cdtype = compute_dtype(gd)
    acc = _accumulator(weight, spec, gd, math.prod(hidden.shape[:-1]))
    h, ids, keep, denom, dh, dw, db, (need_h, need_w, need_b) = _setup(hidden, weight, bias, token_ids, spec,
                                                                         needs, acc, cdtype, True)
    n, vocab = h.shape[0], weight.shape[0]
    need_grad = need_h or need_w or need_b
    opts = spec.options()
    bad_id = keep & ((ids < 0) | (ids >= vocab))
    bad = bad_id if opts.faults is None else bad_id | (keep & opts.faults)
    valid = keep & ~bad
    safe = torch.where(valid & ~bad_id, ids, torch.zeros_like(ids))
    if h.device.type == "cuda":  # CPU ids and temperatures were checked before the call
        address, seq, sync = errors.begin(OP, h.device, spec.ids_shape, vocab)
        with op_range(RANGE):
            if opts.faults is not None:  # any row, ignored or not, as the CPU check raises
                errors.note_native(errors.ERR_BAD_ARG, seq, address, h.device, opts.faults,
                                   torch.full_like(ids, TEMPERATURE_CODE))
            errors.note_native(errors.ERR_LOGP_BAD_ID, seq, address, h.device, bad_id, ids)
        errors.after_call(h.device, sync)
    # the GEMM operands in the compute dtype (a copy of the weight where that differs); float32 logits: float32
    # leaves (one upcast copy of weight), so each chunk's gradients stay float32 until dW
    up = (lambda t: t.float()) if spec.logits32 else (lambda t: precision.cast(t, gd))  # noqa: E731
    w = up(weight.detach()).requires_grad_(need_w)
    b = up(bias.detach()).requires_grad_(need_b) if bias is not None else None
    total = torch.zeros((), dtype=cdtype, device=h.device)
    c = max(1, min(spec.chunk, n))
    for s in range(0, n, c):
        e = min(n, s + c)
        with op_range(RANGE), torch.enable_grad(), precision.no_autocast(h.device):
            hc = up(h[s:e].detach()).requires_grad_(need_h)
            logp, ent = _native_logp(torch.nn.functional.linear(hc, w, b), safe[s:e], valid[s:e], bad[s:e],
                                     opts, s, e, cdtype)
        loss, g_lp, g_en = _apply_loss(spec, logp, ent, slice(s, e), keep[s:e], denom, need_grad)
        total.add_(loss)
        if need_grad:
            with op_range(RANGE):
                outs = [(t, g) for t, g in ((logp, g_lp), (ent, g_en)) if g is not None]
                inputs = [t for t, need in ((hc, need_h), (w, need_w), (b, need_b)) if need]
                got = list(torch.autograd.grad([t for t, _ in outs], inputs, [g for _, g in outs],
                                               allow_unused=True))
                for t in inputs:
                    g = got.pop(0)
                    g = torch.zeros_like(t) if g is None else g
                    if t is hc:
                        dh[s:e] = g
                    elif t is w:
                        dw.add_(g)
                    else:
                        db.add_(g)
    return _result(total, hidden, weight, bias, dh, dw, db)
