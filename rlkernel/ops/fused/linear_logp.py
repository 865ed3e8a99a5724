"""The fused CUDA backend of rlkernel.linear_logp: cuBLAS GEMM tiles into a bounded workspace, reduced by our kernels.

Never an N x V tensor. The rows go a block at a time (``block`` rows) and the vocabulary a chunk at a time (``cols``
columns); ``plan`` picks both so one tile, ``block x cols`` logits in the inputs' dtype, stays within
``TILE_BYTES``.

- Forward, per (block, chunk): one GEMM writes the tile (``addmm`` with the bias slice, else ``mm``, ``out=`` the
  workspace), then ``rlkernel_linear_logp_fold_kernel`` folds it into each row's running online-softmax state; the
  last chunk writes logp, entropy and the stats (r, log2 s) and reports bad ids to the device error record.
- Backward, per (block, chunk): the GEMM again (recompute), ``rlkernel_linear_logp_grad_kernel`` turns the tile in
  place into the logits' gradient, then ``dW[chunk] (+)= G^T @ H_block`` and ``dH_block (+)= G @ W[chunk]`` (a float32
  accumulator where aten's cuBLAS calls allow: ``dh_accumulation``), the bias gradient by the deterministic
  column-sum kernels, and ``rlkernel_linear_logp_cast_kernel`` writes the block's dH in the inputs' dtype.
- ``logits32`` (``logits_dtype=torch.float32``, 16-bit inputs): the tile is float32, written by aten's float32-output
  GEMM of the 16-bit operands (``blas.float32_logits``: cuBLASLt's float32 C/D type, the accumulator never rounded),
  and the fold / grad kernels read it as float32 (their float32 instantiations, those of float32 inputs). The
  backward's gradient tile is rounded once to the inputs' dtype, by the grad kernel itself: it reads the float32
  logits and writes the 16-bit gradient into a second tile (``GRAD_INTO_16BIT``), the dW / dH GEMMs' operand
  (16-bit operands, float32 accumulation). With a bias gradient (its column sums read the float32 gradient) and with
  the option kernels, the grad kernel works in place on the float32 tile and ``rlkernel_linear_logp_cast_kernel``
  rounds it afterwards: the same bits, one more pass. ``plan`` sizes the tile by its float32 elements (half the
  columns). Where the epilogue GEMM runs and no bias gradient or option kernel is asked for
  (``epilogue_gemm.grad_reason``), the recompute and the grad kernel are one Hopper GEMM whose epilogue writes the
  16-bit gradient chunk from its float32 accumulator (``epilogue_gemm.grad_tile``): no float32 tile at all, and
  ``plan`` sizes the chunks by the 16-bit gradient.
- ``batch_invariant=True``: every block has ``BI_ROWS`` rows (hidden rows packed into a zero-padded buffer by
  ``rlkernel_linear_logp_pack_kernel``) and every chunk ``BI_COLS`` columns (the last one the rest): every GEMM call
  has the same problem shape and layout, GEMMs run through cuBLASLt without split-K (``batch_invariant_blas``),
  and a row's reductions run in a fixed order, so its results do not depend on N or on where it sits.

- Mixed precision (``rlkernel.ops.precision``): the GEMM operands are the stored tensors cast to the compute dtype
  (``_operands``: torch's cast / contiguous copies, before the op range, in the forward and again in the backward);
  dW is summed over row blocks in ``grad_accumulation``'s dtype (float32: ``_accumulate_w``, the GEMMs writing and
  adding into a float32 ``[V, H]``, rounded once at the end by the cast kernel when the weight is 16-bit), dH / db
  written by the cast kernel straight in their stored dtypes. A ZeRO-3 weight is gathered again for the backward.

Everything runs inside one NVTX range per call (``op.linear_logp.forward`` / ``.backward``), opened here: cuBLAS
GEMM kernels and ``rlkernel_*`` kernels only. No host sync: bad ids go to the device error record.
"""
from __future__ import annotations

import contextlib
import math

import torch

from rlkernel import _ext, dispatch, errors
from rlkernel.nvtx_ranges import op_range
from rlkernel.ops import precision, second_order, sharded
from rlkernel.ops.blas import batch_invariant_blas, float32_logits, float32_output_gemm
from rlkernel.ops.fused import epilogue_gemm
from rlkernel.ops.fused import linear_logp_options as fused_options
from rlkernel.ops.rows import as_lead, as_rows, flat_ids, row_grad

TILE_BYTES = 512 << 20  # one GEMM tile of logits (at N=16384, bf16: 16384 columns)
MAX_BLOCK_ROWS = 16384  # rows per block in the default mode (more rows: several blocks)
BI_ROWS = 4096  # rows per GEMM with batch_invariant=True (fewer rows are padded up to it; the dH GEMM
# [BI_ROWS x H] needs about two waves of 128 x 256 tiles on 132 SMs to run at full speed)
BI_COLS = 16384  # vocabulary columns per chunk with batch_invariant=True
_COL_ALIGN = 256

# The bias: in cuBLASLt's epilogue through torch.addmm(bias, ...) (True), or written into the tile by
# rlkernel_linear_logp_bias_rows_kernel and added by a beta = 1 GEMM (False: one more write and read of each tile, and
# no copy kernel of torch's in the op range should its addmm not take the epilogue path).
BIAS_EPILOGUE = True
# Float32 logits, 16-bit inputs: the grad kernel writes the 16-bit gradient tile itself (True: one float32 read and
# one 16-bit write), or turns the float32 tile into the gradient in place and the cast kernel rounds it to the 16-bit
# tile afterwards (False: the path before, about 8 more bytes per element; the same bits, which the GPU tests check).
# The bias gradient sums the float32 gradient tile, so with a bias gradient the backward keeps the in-place path.
GRAD_INTO_16BIT = True
_override: tuple[int, int] | None = None  # (block rows, chunk columns) forced by tests (``chunking``)
_dh_modes: dict[tuple, str] = {}  # (device index, dtype) -> how dH is summed over chunks (dh_accumulation)


@contextlib.contextmanager
def chunking(rows: int, cols: int):
    """Force the block and chunk sizes (tests: many blocks and chunks on small shapes)."""
    global _override
    old, _override = _override, (int(rows), int(cols))
    try:
        yield
    finally:
        _override = old


def plan(n: int, vocab: int, dtype: torch.dtype, batch_invariant: bool) -> tuple[int, int]:
    """(block rows, chunk columns). Batch-invariant: fixed, whatever n. Default: one block up to MAX_BLOCK_ROWS rows,
    and as many columns as fit TILE_BYTES (a multiple of 256, so every chunk but the last starts 16-byte aligned)."""
    if _override is not None:
        rows, cols = _override
        return (rows if batch_invariant else min(rows, max(n, 1))), min(cols, vocab)
    if batch_invariant:
        return BI_ROWS, min(BI_COLS, vocab)
    rows = max(1, min(n, MAX_BLOCK_ROWS))
    esize = dtype.itemsize
    cols = max(_COL_ALIGN, TILE_BYTES // (rows * esize) // _COL_ALIGN * _COL_ALIGN)
    # at least two chunks once the vocabulary has more than two aligned chunks' worth: no tile ever holds a block's
    # whole row of logits, however small the problem
    half = -(-vocab // 2 // _COL_ALIGN) * _COL_ALIGN if vocab > 2 * _COL_ALIGN else vocab
    return rows, min(cols, half, vocab)


def dh_accumulation(device: torch.device, dtype: torch.dtype, batch_invariant: bool = False) -> str:
    """How the backward sums the hidden-state gradient over vocabulary chunks, by what aten's cuBLAS calls allow
    (torch versions differ): "addmm" (a float32 accumulator that cuBLAS adds into: ``addmm.dtype_out``), "mm+add"
    (each chunk's float32 product by ``mm.dtype_out``, added by our cast kernel: one more float32 [rows, H]
    buffer), "dtype" (summed in the inputs' dtype, rounded once per chunk). float32 inputs: "addmm". Tried once per
    device and dtype on 2 x 2 tensors: no values read, and nothing but the GEMMs launched (unfilled inputs), so the
    op range it runs in stays GEMMs + ours. batch_invariant: probed (by the caller) under ``batch_invariant_blas``,
    whose settings some of these calls refuse."""
    if dtype == torch.float32:
        return "addmm"
    key = (device.index, dtype, batch_invariant)
    mode = _dh_modes.get(key)
    if mode is None:
        a = torch.empty(2, 2, dtype=dtype, device=device)
        acc = torch.empty(2, 2, dtype=torch.float32, device=device)
        errors_ = (RuntimeError, TypeError, NotImplementedError)
        try:
            torch.ops.aten.mm.dtype_out(a, a, torch.float32, out=acc)
            try:
                torch.ops.aten.addmm.dtype_out(acc, a, a, torch.float32, out=acc)
                mode = "addmm"
            except errors_:
                mode = "mm+add"
        except errors_:
            mode = "dtype"
        _dh_modes[key] = mode
    return mode


def _logits_tile(h, weight, bias, c0, c1, out, bias_mode=None):
    """out = h @ weight[c0:c1].T + bias[c0:c1]; ``bias_mode`` (float32 logits): float32 output, that bias mode."""
    w = weight[c0:c1].t()  # [H, cols]: a transposed view, cuBLAS reads it as is
    if bias_mode is not None:
        float32_logits(h, w, None if bias is None else bias[c0:c1], out, bias_mode)
    elif bias is not None and BIAS_EPILOGUE:
        torch.addmm(bias[c0:c1], h, w, out=out)
    elif bias is not None:
        torch.ops.rlkernel.linear_logp_bias_rows(bias[c0:c1], out)
        torch.addmm(out, h, w, out=out)
    else:
        torch.mm(h, w, out=out)


def _accumulate(acc, g, w, first: bool, tmp):
    """acc (=|+=) g @ w; acc float32 (cuBLAS output type) or of g's dtype; ``tmp`` (float32, like acc): the
    "mm+add" mode's product buffer, else None."""
    if acc.dtype == g.dtype:
        if first:
            torch.mm(g, w, out=acc)
        else:
            torch.addmm(acc, g, w, out=acc)
    elif first:
        torch.ops.aten.mm.dtype_out(g, w, acc.dtype, out=acc)
    elif tmp is None:
        torch.ops.aten.addmm.dtype_out(acc, g, w, acc.dtype, out=acc)
    else:
        torch.ops.aten.mm.dtype_out(g, w, acc.dtype, out=tmp)
        torch.ops.rlkernel.linear_logp_cast(tmp, acc, True)


def _accumulate_w(dw_c, g_t, h, first: bool, mode: str, tmp):
    """dW[chunk] (=|+=) G^T @ H in a float32 accumulator of 16-bit operands (``grad_accumulation="float32"``), by
    ``mode`` (``dh_accumulation``'s probe): float32 GEMM output where aten allows; "dtype" (no float32-output GEMM in
    this torch): the 16-bit product in ``tmp``, added by torch's add kernel (a non-helper kernel in the op range)."""
    if mode == "dtype":
        product = tmp[: dw_c.numel()].view(dw_c.shape)
        torch.mm(g_t, h, out=product)
        if first:
            dw_c.copy_(product)
        else:
            dw_c.add_(product)
        return
    _accumulate(dw_c, g_t, h, first, None if mode == "addmm" or first else tmp[: dw_c.numel()].view(dw_c.shape))


def _blocks(n, block):
    for r0 in range(0, n, block):
        yield r0, min(n, r0 + block)


def _chunks(vocab, cols):
    for c0 in range(0, vocab, cols):
        yield c0, min(vocab, c0 + cols)


def _block_hidden(rows2d, r0, r1, packed):
    """The GEMM's A operand for rows r0..r1: a view, or (batch-invariant) the rows packed into the padded buffer."""
    if packed is None:
        return rows2d[r0:r1]
    torch.ops.rlkernel.linear_logp_pack(rows2d[r0:r1], packed)
    return packed


def _tile_setup(rows2d, batch_invariant, logits32):
    """(tile dtype, bias mode or None): float32 and the float32-output GEMM's bias mode with float32 logits."""
    if not logits32:
        return rows2d.dtype, None
    reason, bias_mode = float32_output_gemm(rows2d.device, rows2d.dtype, batch_invariant)
    if reason is not None:  # blas.float32_fallback records this as a fallback before the fused path is chosen
        raise RuntimeError(f"linear_logp: float32 logits unavailable: {reason}")
    return torch.float32, bias_mode


def _forward(rows2d, weight, bias, ids, temperature, ignore_index, return_entropy, batch_invariant, shape,
             logits32=False, epilogue=False, rows_opt=None):
    """(logp, entropy, stats, extras); ``epilogue``: by the epilogue GEMM (``epilogue_gemm.reason`` said yes), else by
    cuBLAS tiles and the fold kernel (``rows_opt``: the option kernels' fold, rlkernel.ops.fused.linear_logp_options;
    ``extras``: its statistics of ``outputs`` when ``rows_opt.extras``, else None)."""
    n, hsize = rows2d.shape
    vocab = weight.shape[0]
    dev = rows2d.device
    if epilogue:
        address, seq, sync = errors.begin("linear_logp.forward", dev, shape, vocab)
        out = epilogue_gemm.forward(rows2d, weight, bias, ids, temperature, ignore_index, return_entropy, address, seq)
        errors.after_call(dev, sync)
        return tuple(out) + (None,)
    tile_dtype, bias_mode = _tile_setup(rows2d, batch_invariant, logits32)
    block, cols = plan(n, vocab, tile_dtype, batch_invariant)
    f32 = dict(dtype=torch.float32, device=dev)
    logp = torch.empty(n, **f32)
    entropy = torch.empty(n if return_entropy else 0, **f32)
    stats = torch.empty(n, 2, **f32)
    extras = fused_options.extras_buffers(n, block, dev) if rows_opt is not None and rows_opt.extras else None
    if n == 0:
        return logp, entropy, stats, extras
    m = block if batch_invariant else min(block, n)
    tile_buf = torch.empty(m * cols, dtype=tile_dtype, device=dev)
    state = torch.empty(min(block, n) * 4, **f32)
    packed = torch.empty(block, hsize, dtype=rows2d.dtype, device=dev) if batch_invariant else None
    address, seq, sync = errors.begin("linear_logp.forward", dev, shape, vocab)
    with batch_invariant_blas(rows2d.dtype, dev, batch_invariant):
        for r0, r1 in _blocks(n, block):
            h = _block_hidden(rows2d, r0, r1, packed)
            rows = r1 - r0
            for c0, c1 in _chunks(vocab, cols):
                tile = tile_buf[: h.shape[0] * (c1 - c0)].view(h.shape[0], c1 - c0)
                _logits_tile(h, weight, bias, c0, c1, tile, bias_mode)
                if rows_opt is None:
                    torch.ops.rlkernel.linear_logp_fold(
                        tile[:rows], ids[r0:r1], state[: 4 * rows], logp[r0:r1],
                        entropy[r0:r1] if return_entropy else entropy, stats[r0:r1], c0, vocab, temperature,
                        ignore_index, c0 == 0, c1 == vocab, r0, address, seq)
                else:
                    fused_options.fold(rows_opt, tile[:rows], ids[r0:r1], r0, r1, state[: 4 * rows], logp[r0:r1],
                                       entropy[r0:r1] if return_entropy else entropy, stats[r0:r1], c0, vocab,
                                       ignore_index, c0 == 0, c1 == vocab, address, seq, extras)
    errors.after_call(dev, sync)
    return logp, entropy, stats, extras


def _backward(rows2d, weight, bias, ids, stats, entropy, grad_logp, grad_entropy, temperature, ignore_index,
              batch_invariant, need_h, need_w, need_b, logits32=False, rows_opt=None, acc_dtype=None,
              out_dtypes=(None, None)):
    """dH, dW, db of the GEMM operands (rows2d, weight, bias: the compute dtype). dW in ``acc_dtype`` (default the
    operands' dtype); dH / db written in ``out_dtypes`` (their stored dtypes; default the operands') where the cast
    kernel can (from a float32 accumulator), else in the operands' dtype."""
    n, hsize = rows2d.shape
    vocab = weight.shape[0]
    dev, dtype = rows2d.device, rows2d.dtype
    acc_dtype = acc_dtype or dtype
    writable = (torch.float32, torch.bfloat16, torch.float16)  # the cast kernel's destinations
    out_dtypes = tuple(d if d in writable else None for d in out_dtypes)
    if n == 0:  # no rows: nothing reaches the weight or the bias (zeros, not an unwritten buffer)
        return (rows2d.new_empty(0, hsize) if need_h else None,
                torch.zeros(weight.shape, dtype=acc_dtype, device=dev) if need_w else None,
                torch.zeros(vocab, dtype=dtype, device=dev) if need_b else None)
    tile_dtype, bias_mode = _tile_setup(rows2d, batch_invariant, logits32)
    # float32 logits of 16-bit inputs: each chunk's 16-bit gradient straight from the recompute GEMM's epilogue,
    # where it runs (no float32 tile, no grad kernel; the chunks sized by the 16-bit gradient, the one buffer left)
    grad_epi = False
    if tile_dtype != dtype and (need_w or need_h):
        why = epilogue_gemm.grad_reason(rows2d, weight, bias, batch_invariant, need_b, rows_opt)
        epilogue_gemm.record_grad("tile" if why else "epilogue", why or "")
        grad_epi = why is None
    block, cols = plan(n, vocab, dtype if grad_epi else tile_dtype, batch_invariant)
    m = block if batch_invariant else min(block, n)
    dw = torch.empty(weight.shape, dtype=acc_dtype, device=dev) if need_w else None
    db = torch.empty(vocab, dtype=out_dtypes[1] or dtype, device=dev) if need_b else None  # from float32 db32
    tile_buf = None if grad_epi else torch.empty(m * cols, dtype=tile_dtype, device=dev)
    # float32 logits: the gradient tile rounded once to the inputs' dtype, the dW / dH GEMMs' operand
    grad_buf = torch.empty(m * cols, dtype=dtype, device=dev) if tile_dtype != dtype and (need_w or need_h) else None
    # written by the grad kernel itself (GRAD_INTO_16BIT), except where the float32 gradient is read afterwards: the
    # bias column sums, and the option kernels' grad (which has no 16-bit output)
    direct16 = grad_buf is not None and GRAD_INTO_16BIT and not need_b and rows_opt is None
    packed = torch.empty(block, hsize, dtype=dtype, device=dev) if batch_invariant else None
    acc = tmp = dh = tmp_w = None
    mode = dh_accumulation(dev, dtype, batch_invariant) if need_h or (need_w and acc_dtype != dtype) else None
    if need_h:
        acc = torch.empty(m, hsize, dtype=dtype if mode == "dtype" else torch.float32, device=dev)
        if mode == "mm+add" and cols < vocab:
            tmp = torch.empty(m, hsize, dtype=torch.float32, device=dev)
        dh = torch.empty(n, hsize, dtype=(out_dtypes[0] or dtype) if acc.dtype == torch.float32 else dtype,
                         device=dev)
    w_mode = None
    if need_w and acc_dtype != dtype:  # float32 dW of 16-bit operands: summed over blocks by the GEMM
        w_mode = mode
        if mode == "dtype" or (mode == "mm+add" and n > block):  # a product buffer: one chunk's [cols, H]
            tmp_w = torch.empty(cols * hsize, dtype=dtype if mode == "dtype" else torch.float32, device=dev)
    db32 = partial = None
    if need_b:
        db32 = torch.empty(vocab, dtype=torch.float32, device=dev)
        partial = torch.empty(math.ceil(m / 128) * cols, dtype=torch.float32, device=dev)
    for r0, r1 in _blocks(n, block):
        h = _block_hidden(rows2d, r0, r1, packed)
        rows = r1 - r0
        gl = None if grad_logp is None else grad_logp[r0:r1]
        ge = None if grad_entropy is None else grad_entropy[r0:r1]
        ent = entropy[r0:r1] if entropy.numel() else entropy
        for c0, c1 in _chunks(vocab, cols):
            if grad_epi:
                g = grad_buf[: h.shape[0] * (c1 - c0)].view(h.shape[0], c1 - c0)
                epilogue_gemm.grad_tile(h, weight[c0:c1], None if bias is None else bias[c0:c1], ids[r0:r1],
                                        stats[r0:r1], gl, ge, ent, c0, vocab, temperature, ignore_index, g)
            else:
                tile = tile_buf[: h.shape[0] * (c1 - c0)].view(h.shape[0], c1 - c0)
                _logits_tile(h, weight, bias, c0, c1, tile, bias_mode)
                g = tile if grad_buf is None else grad_buf[: tile.numel()].view(tile.shape)
                if rows_opt is None:
                    torch.ops.rlkernel.linear_logp_grad_tile(tile, ids[r0:r1], stats[r0:r1], gl, ge, ent, c0, vocab,
                                                             temperature, ignore_index, g if direct16 else None)
                else:
                    fused_options.grad(rows_opt, tile, rows, ids[r0:r1], r0, r1, stats[r0:r1], gl, ge, ent, c0,
                                       vocab, ignore_index)
                if need_b:  # from the float32 tile with float32 logits
                    torch.ops.rlkernel.linear_logp_colsum(tile, rows, partial, db32[c0:c1], r0 > 0)
                if grad_buf is not None and not direct16:
                    torch.ops.rlkernel.linear_logp_cast(tile, g)
            if need_w and w_mode is not None:
                _accumulate_w(dw[c0:c1], g.t(), h, r0 == 0, w_mode, tmp_w)
            elif need_w:
                dw_c = dw[c0:c1]
                if r0 == 0:
                    torch.mm(g.t(), h, out=dw_c)
                else:
                    torch.addmm(dw_c, g.t(), h, out=dw_c)
            if need_h:
                _accumulate(acc[: h.shape[0]], g, weight[c0:c1], c0 == 0,
                            None if tmp is None else tmp[: h.shape[0]])
        if need_h:
            torch.ops.rlkernel.linear_logp_cast(acc, dh[r0:r1])
    if need_b:
        torch.ops.rlkernel.linear_logp_cast(db32, db)
    return dh, dw, db


class _FusedLinearLogp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows2d, weight, bias, ids, temperature, ignore_index, return_entropy, batch_invariant, shape,
                logits32, epilogue, rows_opt, requested, operands, accumulation, regather):
        # operands: rows2d, weight, bias cast to the compute dtype (the caller's, outside the op range); the stored
        # tensors are saved and cast again for the backward (no compute-dtype copy of a weight kept in between)
        logp, entropy, stats, extras = _forward(*operands, ids, temperature, ignore_index, return_entropy,
                                                batch_invariant, shape, logits32, epilogue, rows_opt)
        ctx.save_for_backward(rows2d, weight, bias, ids, stats, entropy)
        ctx.temperature, ctx.ignore_index, ctx.batch_invariant = temperature, ignore_index, batch_invariant
        # after the epilogue GEMM (float32 logits) the backward's softmax is that of float32 logits too
        ctx.requested, ctx.logits32, ctx.rows_opt = requested, logits32 or epilogue, rows_opt
        ctx.compute, ctx.accumulation, ctx.regather = operands[0].dtype, accumulation, regather
        ctx.set_materialize_grads(False)
        statistics = _statistics(extras)
        ctx.mark_non_differentiable(*(t for t in statistics if t is not None))  # as the native path's
        return (logp, (entropy if return_entropy else None)) + statistics

    @staticmethod
    @second_order.refused("linear_logp.backward")
    def backward(ctx, grad_logp, grad_entropy, *_statistics):
        stored_h, stored_w, stored_b, ids, stats, entropy = ctx.saved_tensors
        dispatch.record("linear_logp.backward", ctx.requested, "fused", "fused")
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        none = (None,) * 13
        if grad_entropy is not None and entropy.numel() == 0:
            grad_entropy = None
        if grad_logp is None and grad_entropy is None:
            return (None, None, None) + none
        cd = ctx.compute
        n = stored_h.shape[0]
        block = plan(n, stored_w.shape[0], torch.float32 if ctx.logits32 else cd, ctx.batch_invariant)[0]
        acc = precision.accumulation_dtype(stored_w.dtype, cd, ctx.accumulation, math.ceil(n / block))
        with sharded.regathered(ctx.regather), precision.no_autocast(stored_h.device):
            rows2d, weight, bias = _operands(stored_h, stored_w, stored_b, cd)  # before the range: torch's casts
            with op_range("op.linear_logp.backward"), batch_invariant_blas(cd, rows2d.device, ctx.batch_invariant):
                dh, dw, db = _backward(
                    rows2d, weight, bias, ids, stats, entropy, row_grad(grad_logp), row_grad(grad_entropy),
                    ctx.temperature, ctx.ignore_index, ctx.batch_invariant, need_h, need_w,
                    need_b and bias is not None, ctx.logits32, ctx.rows_opt, acc,
                    (stored_h.dtype, None if stored_b is None else stored_b.dtype))
                if dw is not None and dw.dtype == torch.float32 and stored_w.dtype in (torch.bfloat16, torch.float16):
                    out = torch.empty(dw.shape, dtype=stored_w.dtype, device=dw.device)
                    torch.ops.rlkernel.linear_logp_cast(dw, out)  # the float32 accumulator rounded once
                    dw = out
        cast = lambda a, like: a if a is None or like is None or a.dtype == like.dtype else a.to(like.dtype)  # noqa
        return (cast(dh, stored_h), cast(dw, stored_w), cast(db, stored_b)) + none


def _statistics(extras) -> tuple:
    """(log_sum_sq_probs, mean_logit, is_top1) of the forward's extras, Nones without them."""
    return (None, None, None) if extras is None else (extras.log_sum_sq, extras.mean_logit, extras.is_top1)


def _operands(rows2d, weight, bias, cd):
    """The GEMM operands: rows2d, weight (contiguous), bias (contiguous) in the compute dtype, detached copies where
    a cast or a copy is needed (torch's kernels: the callers run this outside the op's NVTX range)."""
    with torch.no_grad():
        return (precision.cast(rows2d, cd), precision.cast(weight, cd, contiguous=True),
                precision.cast(bias, cd, contiguous=True))


def linear_logp_fused(hidden, weight, token_ids, *, bias, temperature, ignore_index, return_entropy,
                      batch_invariant=False, requested="auto", logits32=False, rows_opt=None, compute=None,
                      accumulation="float32", regather=()):
    """Fused log-probs (and entropy) of validated CUDA inputs: (logp, entropy or None), float32, shaped like the ids.
    No host sync: bad ids give NaN and go to the device error record (``rlkernel.errors``). ``rows_opt``: a per-row
    temperature, the softcap and the statistics of ``outputs`` (``rlkernel.ops.fused.linear_logp_options.RowsOptions``),
    else None; with its ``extras`` the answer is (logp, entropy or None, log_sum_sq_probs, mean_logit, is_top1), the
    three statistics without gradient."""
    _ext.load()  # raises rlkernel._ext.ExtensionNotBuilt; the ops' schemas and impls are all C++: nothing to register
    cd = compute or hidden.dtype
    lead = hidden.shape[:-1]
    rows2d = as_rows(hidden)
    operands = _operands(rows2d, weight, bias, cd)
    with op_range("op.linear_logp.forward"), precision.no_autocast(hidden.device):
        ids = flat_ids(token_ids)
        rows_c, weight_c, bias_c = operands
        wants_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (hidden, weight, bias))
        why = ("n = 0" if not ids.numel() else "per-row temperature / softcap (the option kernels)"
               if rows_opt is not None else
               epilogue_gemm.reason(rows_c, weight_c, bias_c, bool(batch_invariant), wants_grad,
                                    logits32=bool(logits32)))
        epilogue_gemm.record("cublas" if why else "epilogue", why or "")
        args = (ids, float(temperature), int(ignore_index), bool(return_entropy), bool(batch_invariant),
                token_ids.shape, bool(logits32), why is None, rows_opt)
        if wants_grad:
            logp, entropy, *stats = _FusedLinearLogp.apply(rows2d, weight, bias, *args, requested, operands,
                                                           accumulation, tuple(regather))
        else:
            logp, entropy, _, extras = _forward(*operands, *args)
            entropy = entropy if return_entropy else None
            stats = _statistics(extras)
        out = tuple(as_lead(t, lead) for t in (logp, entropy, *stats))
        return out if rows_opt is not None and rows_opt.extras else out[:2]
