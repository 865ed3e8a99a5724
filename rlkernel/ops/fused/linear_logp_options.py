"""The fused path of rlkernel.linear_logp's options (issue 31): a per-row temperature, the softcap and the extra
statistics of ``outputs``, through the option kernels (csrc/linear_logp_options.cu), called by
rlkernel/ops/fused/linear_logp.py's loops in place of the plain fold / grad when a call has them (a call without them
runs none of this).

- ``logit_scale`` without a softcap is folded into the temperature (z * scale / T = z / (T / scale)): the plain
  kernels for a number, the row kernels for a per-row T.
- ``softcap``: the tile is float32 (the float32-output GEMM of ``logits_dtype=torch.float32``: softcapped logits are
  never rounded to 16 bits), softcapped in place by ``rlkernel_linear_logp_softcap_kernel`` after each GEMM (forward
  and the backward's recompute); the row kernels divide by T and the backward multiplies the gradient by
  scale (1 - (x / cap)^2).
- linear_logp_loss (rlkernel/ops/linear_logp_loss_chunks.py) runs the same fold and grad on its [chunk, V] logits
  (the whole vocabulary as one chunk), the softcap applied once, in the forward.
- entropy without ids: the fold runs with id 0 on every row (no row ignored) and the log-prob is dropped.
- ``outputs`` (log_sum_sq_probs, mean_logit, is_top1): ``rlkernel_linear_logp_fold_extras_kernel``, the row fold
  with those three statistics in the same launch over the same tile (a number T too runs the row kernels then,
  through a [N] vector of it); all three are computed when any is asked (the caller keeps those asked). No gradient.
Everything built here (the [N] float32 temperatures, NaN on rows out of range, and the ids) is made before the op's
range opens, so the range holds GEMMs and rlkernel kernels only; bad rows go to the device error record there too.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from rlkernel import errors
from rlkernel.ops.linear_options import TEMPERATURE_CODE, Options


class RowsOptions(NamedTuple):
    row_t: torch.Tensor  # float32 [N]: each row's divisor (T, or T / logit_scale without a softcap); NaN: a bad row
    softcap: float  # 0: none
    scale: float  # logit_scale, applied by the softcap kernel (1 without a softcap: folded into row_t)
    extras: bool = False  # the statistics of ``outputs`` too (fold_extras)


class Extras(NamedTuple):
    """fold_extras' outputs ([N]) and its running state between vocabulary chunks (4 floats per row of a block)."""
    xstate: torch.Tensor
    log_sum_sq: torch.Tensor
    mean_logit: torch.Tensor
    is_top1: torch.Tensor


def extras_buffers(n: int, block: int, device) -> Extras:
    f32 = dict(dtype=torch.float32, device=device)
    return Extras(torch.empty(4 * min(block, n), **f32), torch.empty(n, **f32), torch.empty(n, **f32),
                  torch.empty(n, dtype=torch.bool, device=device))


def prepare(opts: Options, hidden: torch.Tensor, token_ids, shape, vocab: int, op: str = "linear_logp.forward"):
    """(token ids for the kernels, the scalar temperature, RowsOptions or None, logits32 forced) of a call whose
    options the fused path has (``Options.fused_gap`` None); reports out-of-range temperatures (under ``op``)."""
    n = shape.numel()
    ids = token_ids if token_ids is not None else torch.zeros(shape, dtype=torch.int64, device=hidden.device)
    capped = opts.softcap is not None
    if not opts.per_row and not capped and not opts.extras:  # the plain kernels, T / logit_scale folded
        return ids, opts.temperature / opts.scale, None, False
    t = opts.temperature if opts.per_row else torch.full((n,), opts.temperature, device=hidden.device)
    t = t.float() if capped else (t / opts.scale).float()
    if opts.faults is not None:
        t = torch.where(opts.faults, torch.full_like(t, float("nan")), t)
        address, seq, sync = errors.begin(op, hidden.device, shape, vocab)
        errors.note_native(errors.ERR_BAD_ARG, seq, address, hidden.device, opts.faults,
                           torch.full((n,), TEMPERATURE_CODE, dtype=torch.int64, device=hidden.device))
        errors.after_call(hidden.device, sync)
    rows = RowsOptions(t.contiguous(), float(opts.softcap) if capped else 0.0, opts.scale if capped else 1.0,
                       bool(opts.extras))
    return ids, 1.0, rows, capped


def fold(opt: RowsOptions, tile, ids, r0, r1, state, logp, entropy, stats, c0, vocab, ignore_index, first, last,
         address, seq, extras: Extras | None = None, row0: int | None = None):
    """The forward's fold of one tile (its first r1 - r0 rows) with the options; ``extras`` (``opt.extras``): the
    statistics' buffers, whose rows r0..r1 this tile's fold writes. ``row0``: the error record's position of the
    tile's first row (default r0; 0 where the caller's ``errors.begin`` has the offset, as linear_logp_loss's)."""
    if opt.softcap:
        torch.ops.rlkernel.linear_logp_softcap(tile, opt.softcap, opt.scale)
    row0 = r0 if row0 is None else row0
    if extras is None:
        torch.ops.rlkernel.linear_logp_fold_rows(tile, ids, opt.row_t[r0:r1], state, logp, entropy, stats, c0, vocab,
                                                 ignore_index, first, last, row0, address, seq)
        return
    x = extras
    torch.ops.rlkernel.linear_logp_fold_extras(
        tile, ids, opt.row_t[r0:r1], state, x.xstate[: state.numel()], logp, entropy, stats, x.log_sum_sq[r0:r1],
        x.mean_logit[r0:r1], x.is_top1[r0:r1], c0, vocab, ignore_index, first, last, row0, address, seq)


def grad(opt: RowsOptions, tile, rows, ids, r0, r1, stats, grad_logp, grad_entropy, entropy, c0, vocab,
         ignore_index, capped: bool = False):
    """The backward's gradient of one tile, in place (rows past ``rows``: padding, 0): a recomputed tile is
    softcapped first, one that already is (``capped``: linear_logp_loss keeps its forward's logits) is not."""
    if opt.softcap and not capped:
        torch.ops.rlkernel.linear_logp_softcap(tile[:rows], opt.softcap, opt.scale)
    torch.ops.rlkernel.linear_logp_grad_rows(tile, ids, opt.row_t[r0:r1], stats, grad_logp, grad_entropy, entropy,
                                             c0, vocab, ignore_index, opt.softcap, opt.scale)
