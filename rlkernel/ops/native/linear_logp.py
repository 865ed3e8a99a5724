"""The native (reference) backend of rlkernel.linear_logp: chunked PyTorch.

The rows are taken a token chunk at a time, so no more than ``_CHUNK_BYTES`` of float32 logits (and the same again
for their probabilities) exist at once: never the N x V logits. The backward recomputes each chunk's logits and
feeds their gradient into the hidden-state and weight gradients (written out, so the native path opens its own
``op.linear_logp.backward`` range and records its ``linear_logp.backward`` dispatch).

Mixed precision (``rlkernel.ops.precision``): the autograd function gets the stored tensors and casts them to the
compute dtype in the forward and again in the backward (no cast copy kept between them), with autocast off; the
gradients go back in the stored dtypes, dW / db summed in ``grad_accumulation``'s dtype. A ZeRO-3 weight is gathered
again for the backward (``rlkernel.ops.sharded.regathered``).

Arithmetic: the logits are the matmul's result in the compute dtype (what ``hidden @ weight.T`` gives), then
float32 (float64 for float64 inputs) for the softmax; the backward's GEMMs run in that compute dtype. With float32
logits (``logits32``, 16-bit inputs) the logits GEMM keeps its float32 result: on CUDA aten's float32-output GEMM of
the 16-bit operands (``blas.float32_logits``), on CPU (or a torch without it) ``hidden.float() @ weight.float().T``
(the best CPU reference there is: products of 16-bit values are exact in float32, so the two differ only in the
order of the float32 sums; it follows torch's TF32 setting, off by default).
``batch_invariant=True`` pads every chunk to ``BI_ROWS`` rows and its logits to a multiple of ``_BI_COL_ALIGN``
columns (-inf, probability 0), so each matmul and row reduction sees one shape and every row starts equally aligned
(torch's row reductions split a row by its address), and on CUDA runs the matmuls as the fused path does
(``batch_invariant_blas``: cuBLASLt without split-K).
"""
from __future__ import annotations

import math

import torch

from rlkernel import dispatch, errors
from rlkernel.nvtx_ranges import op_range
from rlkernel.ops import precision, second_order, sharded
from rlkernel.ops.blas import batch_invariant_blas, float32_logits, float32_output_gemm
from rlkernel.ops.linear_options import TEMPERATURE_CODE, Options
from rlkernel.ops.native.softmax import compute_dtype, entropy

_CHUNK_BYTES = 1 << 27  # float32 logits per token chunk (128 MiB; a few such tensors live at once)
BI_ROWS = 128  # rows per matmul with batch_invariant=True
_BI_COL_ALIGN = 16  # batch_invariant: logits rows padded to a multiple of this many columns (64 bytes in float32)


def _chunks(n: int, vocab: int, batch_invariant: bool):
    rows = BI_ROWS if batch_invariant else max(1, _CHUNK_BYTES // (4 * max(vocab, 1)))
    for r0 in range(0, n, rows):
        yield r0, min(n, r0 + rows), rows


def _pad(t, rows, value=0):
    """t with rows appended (filled with ``value``) up to ``rows`` along dim 0."""
    extra = rows - t.shape[0]
    return t if extra <= 0 else torch.cat([t, t.new_full((extra,) + tuple(t.shape[1:]), value)])


def bi_aligned(t, rows):
    """``t`` [r, c] with every row starting 64-byte aligned (MKL's CPU GEMM result for a row depends on the row's
    address): ``t`` itself where it already is (``rows`` rows, a row stride of whole 64-byte units, an aligned
    start), else a fresh zero-filled ``[rows, c']`` block, c' = c rounded up to 64 bytes, holding it."""
    per = max(1, 64 // t.element_size())
    if (t.shape[0] == rows and t.stride(-1) == 1 and t.stride(0) % per == 0 and t.data_ptr() % 64 == 0
            and t.shape[1] % per == 0):
        return t
    block = t.new_zeros((rows, -(-t.shape[1] // per) * per))
    block[: t.shape[0], : t.shape[1]] = t
    return block


def bi_block(t, rows):
    """batch_invariant: ``t``'s rows padded with zero rows to ``rows``, each row 64-byte aligned (a view of
    ``bi_aligned``'s first columns): a row sits alike in every block, whatever the batch (with an odd width the rows
    of a plain block start at alternating alignments)."""
    return bi_aligned(t, rows)[:, : t.shape[1]]


def bi_matmul(a, b_aligned, rows, cols):
    """batch_invariant: the first ``a.shape[0]`` rows and ``cols`` columns of (``a`` padded to ``rows`` rows) @
    ``b_aligned`` (``bi_aligned(b, b.shape[0])``, made once per call by the caller: its zero columns make every
    row of the product 64-byte aligned): one shape and one alignment per row."""
    return (bi_block(a, rows) @ b_aligned)[: a.shape[0], :cols]


def _matmul(h, weight, bias, logits32, batch_invariant=False):
    """h @ weight.T + bias: in the inputs' dtype, or (logits32) float32 from 16-bit operands."""
    if not logits32:
        return torch.addmm(bias, h, weight.t()) if bias is not None else h @ weight.t()
    if h.device.type == "cuda":
        reason, bias_mode = float32_output_gemm(h.device, h.dtype, batch_invariant)
        if reason is None:
            out = torch.empty(h.shape[0], weight.shape[0], dtype=torch.float32, device=h.device)
            return float32_logits(h, weight.t(), bias, out, bias_mode)
    hf = h.float()
    if batch_invariant:  # the float32 copy of an odd-width block has misaligned rows again: align them
        hf = bi_block(hf, hf.shape[0])
    logits = hf @ weight.float().t()
    return logits if bias is None else logits + bias.float()


def _chunk_logits(hidden, weight, bias, r0, r1, rows, batch_invariant, cd, opts, logits32=False):
    """(the chunk's logits as the softmax sees them, the transform's derivative or None): the matmul in the inputs'
    dtype (float32 with logits32), upcast to the compute dtype, then ``opts.apply`` (logit_scale, softcap, / T;
    with the defaults just / T). With
    batch_invariant the chunk keeps ``rows`` rows (zero hidden states appended) and its rows are padded with -inf
    columns to a multiple of _BI_COL_ALIGN: every matmul and every row reduction after it sees one shape and one
    row alignment; callers keep the first r1 - r0 rows and V columns of what they compute."""
    if not batch_invariant:
        return opts.apply(_matmul(hidden[r0:r1], weight, bias, logits32).to(cd), r0, r1)
    h = bi_block(hidden[r0:r1], rows)
    with batch_invariant_blas(h.dtype, h.device):
        logits = _matmul(h, weight, bias, logits32, True)
    vocab = weight.shape[0]
    x = torch.full((rows, -(-vocab // _BI_COL_ALIGN) * _BI_COL_ALIGN), -math.inf, dtype=cd, device=h.device)
    z, deriv = opts.apply(logits.to(cd), r0, r1, rows)
    x[:, :vocab] = z
    return x, deriv


def _softmax_parts(x):
    logp_all = torch.log_softmax(x, dim=-1)
    return logp_all, logp_all.exp()


def _extras(x, logp_all, vocab, safe_ids, names):
    """The statistics of ``names`` for the chunk's rows (TRL's definitions, on z' = transform(z) / T): log sum p^2,
    the mean of z' over the vocabulary, and whether the id is z''s first argmax."""
    got = {}
    if "log_sum_sq_probs" in names:
        got["log_sum_sq_probs"] = torch.logsumexp(2.0 * logp_all, dim=-1)
    if "mean_logit" in names:
        got["mean_logit"] = x[:, :vocab].mean(-1)
    if "is_top1" in names:
        got["is_top1"] = x[:, :vocab].argmax(-1) == safe_ids
    return got


class _NativeLinearLogp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, safe_ids, valid, bad, opts, return_entropy, batch_invariant,
                record, logits32, gemm_dtype, accumulation, regather):
        ctx.save_for_backward(hidden, weight, bias, safe_ids, valid, bad)  # the stored tensors: recast in backward
        hidden, weight, bias = (precision.cast(t, gemm_dtype) for t in (hidden, weight, bias))
        n, vocab = hidden.shape[0], weight.shape[0]
        cd = compute_dtype(gemm_dtype)
        dev = hidden.device
        out = torch.zeros(n, dtype=cd, device=dev) if opts.has_ids else None
        ent = torch.zeros(n, dtype=cd, device=dev) if return_entropy else None
        extra = {name: torch.zeros(n, dtype=torch.bool if name == "is_top1" else cd, device=dev)
                 for name in opts.extras}
        for r0, r1, rows in _chunks(n, vocab, batch_invariant):
            x, _ = _chunk_logits(hidden, weight, bias, r0, r1, rows, batch_invariant, cd, opts, logits32)
            logp_all, p = _softmax_parts(x)
            k = r1 - r0
            if out is not None:
                out[r0:r1] = logp_all[:k].gather(-1, safe_ids[r0:r1].unsqueeze(-1)).squeeze(-1)
            if return_entropy:
                ent[r0:r1] = entropy(p, logp_all)[:k]
            for name, value in _extras(x[:k], logp_all[:k], vocab, safe_ids[r0:r1], opts.extras).items():
                extra[name][r0:r1] = value
        zero, nan = torch.zeros((), dtype=cd, device=dev), torch.full((), math.nan, dtype=cd, device=dev)
        keep = lambda a: torch.where(bad, nan, torch.where(valid, a, zero))  # noqa: E731
        out = keep(out) if out is not None else None
        ent = keep(ent) if ent is not None else None
        for name, value in extra.items():
            extra[name] = (value & valid) if name == "is_top1" else keep(value)
        stats = tuple(extra.get(name) for name in ("log_sum_sq_probs", "mean_logit", "is_top1"))
        ctx.mark_non_differentiable(*(t for t in stats if t is not None))
        ctx.opts, ctx.batch_invariant, ctx.record, ctx.logits32 = opts, batch_invariant, record, logits32
        ctx.gemm_dtype, ctx.accumulation, ctx.regather = gemm_dtype, accumulation, regather
        ctx.device = hidden.device
        ctx.set_materialize_grads(False)
        return (out, ent) + stats

    @staticmethod
    @second_order.refused("linear_logp.backward")
    def backward(ctx, grad_logp, grad_ent, *_stats):
        requested, status, reason = ctx.record
        dispatch.record("linear_logp.backward", requested, "native", status, reason)
        with sharded.regathered(ctx.regather), precision.no_autocast(ctx.device):
            return _NativeLinearLogp._backward(ctx, grad_logp, grad_ent)

    @staticmethod
    def _backward(ctx, grad_logp, grad_ent):
        stored_h, stored_w, stored_b, safe_ids, valid, bad = ctx.saved_tensors
        hidden, weight, bias = (precision.cast(t, ctx.gemm_dtype) for t in (stored_h, stored_w, stored_b))
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        with op_range("op.linear_logp.backward"):
            n, vocab = hidden.shape[0], weight.shape[0]
            cd = compute_dtype(hidden.dtype)
            opts = ctx.opts
            acc = precision.accumulation_dtype(stored_w.dtype, ctx.gemm_dtype, ctx.accumulation)
            w = weight.to(cd)
            dh = torch.zeros(hidden.shape, dtype=cd, device=hidden.device) if need_h else None
            w_bi = bi_aligned(w, vocab) if need_h and ctx.batch_invariant else None  # once, not per chunk
            dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
            db = torch.zeros(vocab, dtype=acc, device=weight.device) if need_b else None
            if grad_logp is None and grad_ent is None:
                n = 0  # nothing reaches the outputs: zero gradients
            for r0, r1, rows in _chunks(n, vocab, ctx.batch_invariant):
                x, deriv = _chunk_logits(hidden, weight, bias, r0, r1, rows, ctx.batch_invariant, cd, opts,
                                         ctx.logits32)
                m, k = x.shape[0], r1 - r0  # m = k, or the padded chunk (batch_invariant)
                logp_all, p = _softmax_parts(x)
                g = torch.zeros_like(x)
                if grad_logp is not None:
                    gl = _pad(grad_logp[r0:r1].to(cd), m).unsqueeze(-1)
                    onehot = torch.zeros_like(x).scatter_(-1, _pad(safe_ids[r0:r1], m).unsqueeze(-1), 1.0)
                    g = g + gl * (onehot - p)
                if grad_ent is not None:
                    ent = entropy(p, logp_all).unsqueeze(-1)
                    # dH/dx_j = -p_j (log p_j + H); 0 where p_j = 0
                    g = g - _pad(grad_ent[r0:r1].to(cd), m).unsqueeze(-1) * torch.where(p > 0, p * (logp_all + ent),
                                                                                         0.0)
                t = opts.rows_temperature(r0, r1, m)
                g = torch.where(_pad(valid[r0:r1], m, False).unsqueeze(-1), g / t, 0.0)  # padding rows: 0
                g = torch.where(_pad(bad[r0:r1], m, False).unsqueeze(-1), math.nan, g)  # a bad id: NaN gradients
                g = g[:, :vocab]  # the logits' columns (batch_invariant padded them)
                if deriv is not None:  # through softcap / logit_scale: d z' / d z = scale (1 - tanh^2)
                    g = g * deriv
                if need_h:
                    with batch_invariant_blas(cd, g.device, ctx.batch_invariant):
                        # the padded chunk's GEMM with batch_invariant: one shape, rows aligned alike
                        dh[r0:r1] = bi_matmul(g[:k], w_bi, m, w.shape[1]) if ctx.batch_invariant else g @ w
                g = g[:k]
                if need_w:  # "input" accumulation of a 16-bit weight: each chunk's float32 product rounded
                    dw += (g.t() @ hidden[r0:r1].to(cd)).to(acc)
                if need_b:
                    db += g.sum(0).to(acc)
            cast = lambda a, like: a.to(like.dtype) if a is not None else None  # noqa: E731
            return (cast(dh, stored_h), cast(dw, stored_w), cast(db, stored_b) if bias is not None else None,
                    None, None, None, None, None, None, None, None, None, None, None)


def linear_logp_native(hidden, weight, token_ids, *, bias, temperature, ignore_index, return_entropy,
                       batch_invariant=False, requested="native", fallback_reason="", keep_dtype=False,
                       logits32=False, opts: Options | None = None, compute=None, accumulation="float32",
                       regather=()):
    """Native log-probs of validated inputs: (logp, entropy or None), float32; ``keep_dtype`` keeps float64 for
    float64 inputs (gradcheck). ``opts`` (rlkernel.ops.linear_options, checked): the per-row temperature, softcap,
    logit_scale, extra statistics and token_ids=None; then the answer is (logp or None, entropy or None,
    log_sum_sq_probs, mean_logit, is_top1), None for what is not asked. On CUDA a bad id or per-row temperature gives
    NaN and goes to the device error record by tensor ops on the stream (no host sync). The whole call runs inside
    ``op.linear_logp.forward``."""
    full = opts is not None
    opts = opts if full else Options(float(temperature))
    with op_range("op.linear_logp.forward"):
        lead, vocab = hidden.shape[:-1], weight.shape[0]
        rows = hidden.reshape(-1, hidden.shape[-1])
        if token_ids is not None:
            ids = token_ids.reshape(-1).long()
            valid = ids != ignore_index
            bad_id = valid & ((ids < 0) | (ids >= vocab))
        else:  # entropy / statistics alone: every row counts
            ids = torch.zeros(rows.shape[0], dtype=torch.long, device=hidden.device)
            valid = torch.ones_like(ids, dtype=torch.bool)
            bad_id = torch.zeros_like(valid)
        bad = bad_id if opts.faults is None else bad_id | (valid & opts.faults)
        valid = valid & ~bad
        safe = torch.where(valid, ids, torch.zeros_like(ids))
        status = "fallback" if fallback_reason else "native"
        with precision.no_autocast(hidden.device):
            res = _NativeLinearLogp.apply(rows, weight, bias, safe, valid, bad, opts, bool(return_entropy),
                                          bool(batch_invariant), (requested, status, fallback_reason), bool(logits32),
                                          compute or hidden.dtype, accumulation, tuple(regather))
        if hidden.device.type == "cuda":
            address, seq, sync = errors.begin("linear_logp.forward", hidden.device, lead, vocab)
            if opts.faults is not None:  # on any row, ignored or not, as the CPU check raises
                errors.note_native(errors.ERR_BAD_ARG, seq, address, hidden.device, opts.faults,
                                   torch.full_like(ids, TEMPERATURE_CODE))
            errors.note_native(errors.ERR_LOGP_BAD_ID, seq, address, hidden.device, bad_id, ids)
            errors.after_call(hidden.device, sync)
        shaped = []
        for t in res:
            if t is not None and not keep_dtype and t.is_floating_point():
                t = t.float()
            shaped.append(t.view(lead) if t is not None else None)
        return tuple(shaped) if full else tuple(shaped[:2])
