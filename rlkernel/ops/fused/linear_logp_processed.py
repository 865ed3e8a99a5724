"""The fused CUDA backend of rlkernel.linear_logp's processed mode (filters, or a kept set given as CSR).

Row blocks, each one GEMM of the block's full-vocabulary logits into a workspace of at most ``TILE_BYTES``
(``block = TILE_BYTES / (V x itemsize)`` rows: 2048 rows at V = 128256 in bf16), then the processed log-prob
kernels of ``rlkernel.logp`` on that workspace (``torch.ops.rlkernel.logp_processed_forward``: the sampler's own
filter code, S in fixed point), so the kept set and the values are bitwise ``rlkernel.logp``'s on the same logits.
Never the N x V logits: one block's. With ``batch_invariant`` the block's logits are the batch-invariant tiles of
``rlkernel.linear_logits`` (packed ``BI_ROWS`` rows, ``BI_COLS``-column cuBLASLt GEMMs), copied into a
``[BI_ROWS, V]`` workspace: ``linear_logp(..., filters, batch_invariant=True)`` is then bitwise ``rlkernel.logp(
rlkernel.linear_logits(...), filters)`` on CUDA.

Backward, per block: the GEMM again, ``logp_processed_backward`` (the kept set fixed by the forward's saved
per-row threshold) into a ``[block, V]`` gradient, rounded to the inputs' dtype for the dW / dH GEMMs (float32
logits: once, as the plain path does), the bias gradient summed in float32.

A CSR kept set (``kept_ids``): the same blocks, the values and gradient by the native kept-set code
(``native.linear_logp_processed.KeptSet``) as torch ops on the workspace.

Not yet the single-pass design (a per-row top-k candidate list merged across vocabulary chunks with the online
softmax, then the top-p / min-p cut; a threshold search for top-p alone): this path costs one extra read of each
block's logits by the processed kernels and, in the backward, a full [block, V] gradient buffer.
"""
from __future__ import annotations

import math

import torch

from rlkernel import _ext, dispatch, errors
from rlkernel.nvtx_ranges import op_range
from rlkernel.ops import second_order
from rlkernel.ops.blas import batch_invariant_blas, float32_output_gemm
from rlkernel.ops.fused import logp_processed
from rlkernel.ops.fused.linear_logp import TILE_BYTES, _logits_tile, plan
from rlkernel.ops.linear_logits import cuda_bi_tiles
from rlkernel.ops.native.linear_logp_processed import KeptSet
from rlkernel.ops.native.logp_processed import processed_grad, processed_values
from rlkernel.ops.rows import as_lead, as_rows, flat_ids, row_grad, split_setting
from rlkernel.validate import row_faults

_override_rows: int | None = None  # block rows forced by tests (many blocks on small shapes)


def block_rows(n: int, vocab: int, tile_dtype: torch.dtype, batch_invariant: bool) -> int:
    """Rows per block: the batch-invariant GEMM block (fixed), else as many rows as TILE_BYTES holds."""
    if batch_invariant:
        return plan(n, vocab, tile_dtype, True)[0]
    if _override_rows is not None:
        return max(1, min(_override_rows, n))
    return max(1, min(n, TILE_BYTES // (vocab * tile_dtype.itemsize)))


class _Ctx:
    """What a call's blocks share: the GEMM setup and its buffers."""

    def __init__(self, rows2d, weight, bias, batch_invariant, logits32):
        self.rows2d, self.weight, self.bias = rows2d, weight, bias
        self.bi, self.logits32 = batch_invariant, logits32
        n, hsize = rows2d.shape
        self.vocab = weight.shape[0]
        self.tile_dtype = torch.float32 if logits32 else rows2d.dtype
        self.bias_mode = float32_output_gemm(rows2d.device, rows2d.dtype, batch_invariant)[1] if logits32 else None
        self.block = block_rows(n, self.vocab, self.tile_dtype, batch_invariant)
        dev = rows2d.device
        self.ws = torch.empty(min(self.block, n) * self.vocab, dtype=self.tile_dtype, device=dev)
        self.packed = self.tile_buf = None
        if batch_invariant:
            cols = plan(n, self.vocab, self.tile_dtype, True)[1]
            self.packed = torch.empty(self.block, hsize, dtype=rows2d.dtype, device=dev)
            self.tile_buf = torch.empty(self.block * cols, dtype=self.tile_dtype, device=dev)

    def blocks(self):
        n = self.rows2d.shape[0]
        for r0 in range(0, n, self.block):
            yield r0, min(n, r0 + self.block)

    def logits(self, r0, r1):
        """The block's [r1 - r0, V] logits in the workspace (the caller holds batch_invariant_blas)."""
        x = self.ws[: (r1 - r0) * self.vocab].view(r1 - r0, self.vocab)
        if self.bi:
            cuda_bi_tiles(self.rows2d, self.weight, self.bias, self.logits32, r0, r1, self.packed, self.tile_buf, x)
        else:
            _logits_tile(self.rows2d[r0:r1], self.weight, self.bias, 0, self.vocab, x, self.bias_mode)
        return x


def _slice(rows, r0, r1):
    return None if rows is None else rows[r0:r1]


def _forward(c: _Ctx, ids, settings, csr, ignore_index, return_entropy, shape, requested):
    n = c.rows2d.shape[0]
    dev = c.rows2d.device
    f32 = dict(dtype=torch.float32, device=dev)
    logp = torch.empty(n, **f32)
    entropy = torch.empty(n if return_entropy else 0, **f32)
    stats = torch.empty(n, 4, **f32)
    threshold = torch.empty(n, dtype=torch.int64, device=dev)
    bad_rows = torch.zeros(n if csr is not None else 0, dtype=torch.bool, device=dev)
    t, t_rows = split_setting(settings.temperature, 1.0, torch.float32)
    k, k_rows = split_setting(settings.top_k, 0, torch.int64)
    p, p_rows = split_setting(settings.top_p, 1.0, torch.float32)
    mp, mp_rows = split_setting(settings.min_p, 0.0, torch.float32)
    address, seq, sync = errors.begin("linear_logp.forward", dev, shape, c.vocab)
    if csr is not None:
        valid = ids != ignore_index
        bad_id = valid & ((ids < 0) | (ids >= c.vocab))
        errors.note_native(errors.ERR_LOGP_BAD_ID, seq, address, dev, bad_id, ids)
        safe = torch.where(valid & ~bad_id, ids, torch.zeros_like(ids))
        faults = row_faults(settings)  # a per-row temperature out of range
        if faults is not None:
            errors.note_native(errors.ERR_BAD_ARG, seq, address, dev, faults[0], faults[1])
            bad_id = bad_id | (valid & faults[0])
        valid = valid & ~bad_id
    with batch_invariant_blas(c.rows2d.dtype, dev, c.bi):
        for r0, r1 in c.blocks():
            x = c.logits(r0, r1)
            if csr is None:
                if r0 > 0:  # each block its own entry, offset to its first row: positions name the whole call
                    address, seq, _ = errors.begin("linear_logp.forward", dev, shape, c.vocab, r0)
                lp, en, st, th = torch.ops.rlkernel.logp_processed_forward(
                    x, ids[r0:r1], float(t), int(k), float(p), float(mp), _slice(t_rows, r0, r1),
                    _slice(k_rows, r0, r1), _slice(p_rows, r0, r1), _slice(mp_rows, r0, r1), ignore_index,
                    return_entropy, address, seq, errors.ERR_LOGP_BAD_ID, requested)
                stats[r0:r1], threshold[r0:r1] = st, th
            else:
                f = KeptSet(x, settings.temperature, csr, r0, r1)
                lp, en, b = processed_values(f, safe[r0:r1], valid[r0:r1], bad_id[r0:r1], return_entropy)
                bad_rows[r0:r1] = b
            logp[r0:r1] = lp
            if return_entropy:
                entropy[r0:r1] = en
    errors.after_call(dev, sync)
    return logp, entropy, stats, threshold, bad_rows


def _backward(c: _Ctx, ids, stats, threshold, bad_rows, settings, csr, grad_logp, grad_entropy, ignore_index,
              need_h, need_w, need_b):
    n, hsize = c.rows2d.shape
    dev, dtype = c.rows2d.device, c.rows2d.dtype
    dh = torch.empty(n, hsize, dtype=dtype, device=dev) if need_h else None
    dw = torch.zeros_like(c.weight, memory_format=torch.contiguous_format) if need_w else None
    db32 = torch.zeros(c.vocab, dtype=torch.float32, device=dev) if need_b else None
    gpad = torch.zeros(c.block, c.vocab, dtype=dtype, device=dev) if c.bi and need_h else None
    if csr is not None:
        valid = (ids != ignore_index) & (ids >= 0) & (ids < c.vocab)
        safe = torch.where(valid, ids, torch.zeros_like(ids))
        valid = valid & ~bad_rows
    with batch_invariant_blas(dtype, dev, c.bi):
        for r0, r1 in c.blocks():
            x = c.logits(r0, r1)
            if csr is None:
                g = torch.ops.rlkernel.logp_processed_backward(
                    _slice(grad_logp, r0, r1), _slice(grad_entropy, r0, r1), x, ids[r0:r1], stats[r0:r1],
                    threshold[r0:r1], ignore_index)
            else:
                f = KeptSet(x, settings.temperature, csr, r0, r1)
                g = processed_grad(f, safe[r0:r1], valid[r0:r1], bad_rows[r0:r1], _slice(grad_logp, r0, r1),
                                   _slice(grad_entropy, r0, r1))
            if need_b:
                db32 += g.sum(0, dtype=torch.float32)
            g = g if g.dtype == dtype else g.to(dtype)  # float32 logits: the gradient rounded once
            h = c.rows2d[r0:r1]
            if need_w:
                torch.addmm(dw, g.t(), h, out=dw)
            if need_h:
                if gpad is None:
                    torch.mm(g, c.weight, out=dh[r0:r1])
                else:  # one GEMM shape per call: the block padded with zero rows
                    gpad[: r1 - r0].copy_(g)
                    gpad[r1 - r0:].zero_()
                    dh[r0:r1] = (gpad @ c.weight)[: r1 - r0]
    return dh, dw, (db32.to(dtype) if need_b else None)


class _FusedLinearProcessed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows2d, weight, bias, ids, settings, csr, ignore_index, return_entropy, batch_invariant,
                logits32, shape, requested):
        c = _Ctx(rows2d, weight, bias, batch_invariant, logits32)
        logp, entropy, stats, threshold, bad_rows = _forward(c, ids, settings, csr, ignore_index, return_entropy,
                                                             shape, requested)
        ctx.save_for_backward(rows2d, weight, bias, ids, stats, threshold, bad_rows)
        ctx.settings, ctx.csr, ctx.ignore_index = settings, csr, ignore_index
        ctx.batch_invariant, ctx.logits32, ctx.requested, ctx.has_entropy = (batch_invariant, logits32, requested,
                                                                              return_entropy)
        ctx.set_materialize_grads(False)
        return logp, (entropy if return_entropy else None)

    @staticmethod
    @second_order.refused("linear_logp.backward")
    def backward(ctx, grad_logp, grad_entropy):
        rows2d, weight, bias, ids, stats, threshold, bad_rows = ctx.saved_tensors
        dispatch.record("linear_logp.backward", ctx.requested, "fused", "fused")
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        none = (None,) * 9
        if not ctx.has_entropy:
            grad_entropy = None
        if grad_logp is None and grad_entropy is None:
            return (None, None, None) + none
        with op_range("op.linear_logp.backward"):
            c = _Ctx(rows2d, weight, bias, ctx.batch_invariant, ctx.logits32)
            dh, dw, db = _backward(c, ids, stats, threshold, bad_rows, ctx.settings, ctx.csr, row_grad(grad_logp),
                                   row_grad(grad_entropy), ctx.ignore_index, need_h, need_w,
                                   need_b and bias is not None)
        return (dh, dw, db) + none


def linear_logp_processed_fused(hidden, weight, token_ids, *, bias, settings, csr, ignore_index, return_entropy,
                                batch_invariant=False, requested="auto", logits32=False):
    """Fused processed log-probs (and filtered entropy) of validated CUDA inputs: (logp, entropy or None), float32,
    shaped like the ids. No host sync: bad ids and per-row settings give NaN and go to the device error record
    (positions counted over the whole call)."""
    _ext.load()
    logp_processed.ensure_registered()
    with op_range("op.linear_logp.forward"):
        lead = hidden.shape[:-1]
        rows2d = as_rows(hidden)
        ids = flat_ids(token_ids)
        weight_c = weight if weight.is_contiguous() else weight.contiguous()
        bias_c = bias if bias is None or bias.is_contiguous() else bias.contiguous()
        if math.prod(lead) == 0:
            z = torch.zeros(lead, dtype=torch.float32, device=hidden.device)
            return z, (z.clone() if return_entropy else None)
        args = (rows2d, weight_c, bias_c, ids, settings, csr, int(ignore_index), bool(return_entropy),
                bool(batch_invariant), bool(logits32), token_ids.shape, requested)
        wants_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
        if wants_grad:
            logp, entropy = _FusedLinearProcessed.apply(*args)
        else:
            c = _Ctx(rows2d, weight_c, bias_c, batch_invariant, logits32)
            logp, entropy, _, _, _ = _forward(c, *args[3:8], token_ids.shape, requested)
            entropy = entropy if return_entropy else None
        return as_lead(logp, lead), as_lead(entropy, lead)
