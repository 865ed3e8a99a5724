"""rlkernel.linear_logits: ``hidden @ weight.T + bias`` by the GEMMs rlkernel's linear ops use, so a rollout can
sample from exactly the logits the trainer's ``rlkernel.linear_logp(..., batch_invariant=True)`` scores.

``batch_invariant=True`` (the default) runs the batch-invariant GEMM scheme of ``linear_logp``: on CUDA the fused
path's tiles (the rows packed into zero-padded blocks of ``BI_ROWS`` rows, the vocabulary in chunks of ``BI_COLS``
columns, each tile one cuBLASLt GEMM without split-K under ``blas.batch_invariant_blas``), on CPU the native path's
(chunks zero-padded to 128 rows). A row's logits are then bitwise the same whatever the number of rows and wherever
the row sits, and bitwise the logits ``linear_logp``'s processed mode computes for it on the same device, so
``rlkernel.logp(linear_logits(h, w), ids, filters...)`` is bitwise ``linear_logp(h, w, ids, filters...,
batch_invariant=True)`` (docs/contracts.md, section 1). Plain torch GEMM calls: no extension needed.
"""
from __future__ import annotations

import math

import torch

from rlkernel.ops import blas
from rlkernel.ops.fused.linear_logp import _logits_tile, plan
from rlkernel.ops.native.linear_logp import BI_ROWS as NATIVE_BI_ROWS
from rlkernel.ops.native.linear_logp import _matmul, bi_block
from rlkernel.validate import check_linear_args, check_logits_dtype


def logits_rows(rows2d: torch.Tensor, weight: torch.Tensor, bias, batch_invariant: bool, logits32: bool):
    """[n, V] logits of validated ``rows2d [n, H]``: in the inputs' dtype, float32 with ``logits32`` (16-bit inputs).
    Not batch-invariant: one GEMM of the rows as given. Batch-invariant: the scheme of the module docstring."""
    n, vocab = rows2d.shape[0], weight.shape[0]
    out_dtype = torch.float32 if logits32 else rows2d.dtype
    if not batch_invariant:
        return _matmul(rows2d, weight, bias, logits32)
    if rows2d.device.type != "cuda":
        out = torch.empty(n, vocab, dtype=out_dtype, device=rows2d.device)
        with blas.batch_invariant_blas(rows2d.dtype, rows2d.device):
            for r0 in range(0, n, NATIVE_BI_ROWS):
                r1 = min(n, r0 + NATIVE_BI_ROWS)
                out[r0:r1] = _matmul(bi_block(rows2d[r0:r1], NATIVE_BI_ROWS), weight, bias, logits32, True)[: r1 - r0]
        return out
    return _cuda_bi_rows(rows2d, weight, bias, logits32, out_dtype)


def cuda_bi_tiles(rows2d, weight, bias, logits32, r0, r1, packed, tile_buf, out):
    """Rows r0..r1 of the batch-invariant CUDA logits into ``out [r1 - r0, V]``: the rows packed into ``packed``
    (the fused path's [BI block, H] zero-padded block), one tile GEMM per vocabulary chunk into ``tile_buf``, the
    block's real rows copied out. The caller holds ``batch_invariant_blas``."""
    block, cols = plan(rows2d.shape[0], weight.shape[0], out.dtype, True)
    vocab, rows = weight.shape[0], r1 - r0
    bias_mode = blas.float32_output_gemm(rows2d.device, rows2d.dtype, True)[1] if logits32 else None
    packed[rows:].zero_()
    packed[:rows].copy_(rows2d[r0:r1])
    for c0 in range(0, vocab, cols):
        c1 = min(vocab, c0 + cols)
        tile = tile_buf[: block * (c1 - c0)].view(block, c1 - c0)
        _logits_tile(packed, weight, bias, c0, c1, tile, bias_mode)
        out[:, c0:c1].copy_(tile[:rows])


def _cuda_bi_rows(rows2d, weight, bias, logits32, out_dtype):
    n, vocab = rows2d.shape[0], weight.shape[0]
    block, cols = plan(n, vocab, out_dtype, True)
    out = torch.empty(n, vocab, dtype=out_dtype, device=rows2d.device)
    if n == 0:
        return out
    packed = torch.empty(block, rows2d.shape[1], dtype=rows2d.dtype, device=rows2d.device)
    tile_buf = torch.empty(block * cols, dtype=out_dtype, device=rows2d.device)
    with blas.batch_invariant_blas(rows2d.dtype, rows2d.device):
        for r0 in range(0, n, block):
            r1 = min(n, r0 + block)
            cuda_bi_tiles(rows2d, weight, bias, logits32, r0, r1, packed, tile_buf, out[r0:r1])
    return out


def linear_logits(hidden: torch.Tensor, weight: torch.Tensor, bias=None, *, batch_invariant: bool = True,
                  logits_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``hidden @ weight.T + bias`` as ``[..., V]`` logits in the inputs' dtype (float32 from the GEMM's accumulator
    with ``logits_dtype=torch.float32`` and 16-bit inputs). ``batch_invariant=True``: by the batch-invariant GEMM of
    ``rlkernel.linear_logp`` (a row's logits do not depend on the other rows), the logits that
    ``linear_logp(..., batch_invariant=True)`` scores, so ``rlkernel.logp`` / ``rlkernel.sample`` on them agree with
    it bit for bit. No autograd through it (the rollout's logits; the trainer uses ``linear_logp``). Arguments as
    for ``linear_logp``. See docs/contracts.md, section 1."""
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"batch_invariant must be a bool, got {type(batch_invariant).__name__}")
    logits32 = check_logits_dtype(logits_dtype)
    if isinstance(hidden, torch.Tensor) and hidden.dim() >= 1:
        ids = torch.zeros((), dtype=torch.int64, device=hidden.device).expand(hidden.shape[:-1])
    else:
        ids = torch.zeros((), dtype=torch.int64)
    check_linear_args(hidden, weight, ids, bias, 1.0, -100, "linear_logits")
    logits32 = logits32 and hidden.dtype in blas.SIXTEEN_BIT
    rows2d = hidden.reshape(math.prod(hidden.shape[:-1]), hidden.shape[-1])
    with torch.no_grad():
        out = logits_rows(rows2d, weight, bias, batch_invariant, logits32)
    return out.view(*hidden.shape[:-1], weight.shape[0])
