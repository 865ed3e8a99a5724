"""The native processed mode of rlkernel.linear_logp: log-probs under the sampler's filtered distribution, straight
from hidden states, a token chunk at a time (never the N x V logits beyond one chunk).

Per chunk: the chunk's logits by the caller's ``gemm`` (the GEMM ``rlkernel.linear_logits`` runs, so with
``batch_invariant`` the logits are bitwise those a rollout sampled from), then the kept set and the values by the
code of ``rlkernel.logp``'s processed mode (``filters.Filtered``, ``logp_processed.processed_values``): the kept
set is the sampler's for those logits. The backward recomputes each chunk's logits and kept set (the same bits) and
holds it fixed (``logp_processed.processed_grad``), then dH = G @ W, dW += G^T @ H, db += sum G.

A kept set supplied by the rollout (``kept_ids`` / ``kept_offsets``, CSR, vLLM's ``return_sampling_mask``) replaces
the filters: ``KeptSet`` gives the same attributes as ``Filtered`` for it.

Chunks hold ``CHUNK_ROWS`` rows at most (a multiple of 16: a chunk's rows start at the same 64-byte phase as in the
full logits tensor, so torch's vectorised CPU kernels split them alike), fewer for a vocabulary whose float32 chunk
would pass ``_CHUNK_BYTES``; with ``batch_invariant`` every chunk's dH GEMM sees one shape (the last chunk padded).
"""
from __future__ import annotations

import torch

from rlkernel import dispatch, errors
from rlkernel.nvtx_ranges import op_range
from rlkernel.ops import second_order
from rlkernel.ops.blas import batch_invariant_blas
from rlkernel.ops.native.filters import Filtered, column, row_sum
from rlkernel.ops.native.linear_logp import bi_aligned, bi_matmul
from rlkernel.ops.native.logp_processed import processed_grad, processed_values
from rlkernel.ops.native.softmax import compute_dtype
from rlkernel.validate import row_faults

_CHUNK_BYTES = 1 << 26  # float32 logits per chunk (64 MiB: the kept-set code holds several such tensors at once)
CHUNK_ROWS = 1024


def chunk_rows(vocab: int) -> int:
    rows = max(16, _CHUNK_BYTES // (4 * max(vocab, 1)) // 16 * 16)
    return min(rows, CHUNK_ROWS)


class KeptSet:
    """The kept set given as CSR (``kept_ids``, ``kept_offsets``) for rows r0..r1 of [rows, V] logits, with the
    attributes ``processed_values`` / ``processed_grad`` read (those of ``filters.Filtered``). Temperature scales as
    for the filters (T = 0 rows: scale 1, the kept set as given, not greedy). ``bad_rows``: rows naming an id
    outside [0, V) (NaN, as a bad setting)."""

    def __init__(self, logits, temperature, csr, r0: int, r1: int):
        kept_ids, row_of = csr
        rows, vocab = logits.shape
        dt = compute_dtype(logits.dtype)
        t = column(temperature, rows, dt, logits.device) if not isinstance(temperature, torch.Tensor) else \
            temperature[r0:r1].to(dt).view(rows, 1)
        self.greedy = torch.zeros(rows, dtype=torch.bool, device=logits.device)
        self.scale = torch.reciprocal(torch.where(t > 0, t, torch.ones_like(t)))
        self.x = logits.to(dt) * self.scale
        self.m = self.x.amax(dim=-1, keepdim=True)
        self.e = torch.exp(self.x - self.m)
        ids = kept_ids.long()
        here = (row_of >= r0) & (row_of < r1)
        in_range = (ids >= 0) & (ids < vocab)
        r = (row_of - r0).clamp(0, max(rows - 1, 0))
        flat = r * vocab + ids.clamp(0, vocab - 1)
        count = torch.zeros(rows * vocab, dtype=torch.int32, device=logits.device)
        count.index_add_(0, flat, (here & in_range).to(torch.int32))
        self.kept = (count > 0).view(rows, vocab)
        out_of_range = torch.zeros(rows, dtype=torch.int32, device=logits.device)
        self.bad_rows = out_of_range.index_add_(0, r, (here & ~in_range).to(torch.int32)) > 0
        self.s = row_sum(torch.where(self.kept, self.e, torch.zeros_like(self.e))).unsqueeze(-1)
        self.log_s = torch.log(self.s)

    def kept_probs(self) -> torch.Tensor:
        return torch.where(self.kept, self.e / self.s, torch.zeros_like(self.e))

    def no_distribution(self) -> torch.Tensor:
        """A NaN or +inf among the logits, no finite one, or an empty kept set (S = 0)."""
        return ~torch.isfinite(self.e).all(dim=-1) | (self.s.view(-1) == 0) | self.bad_rows


def csr_rows(kept_ids: torch.Tensor, kept_offsets: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept ids [nnz], the row of each entry [nnz]) of a validated CSR kept set, no host sync (output_size given)."""
    counts = (kept_offsets[1:] - kept_offsets[:-1]).long()
    rows = torch.arange(n, device=kept_ids.device)
    return kept_ids.reshape(-1), torch.repeat_interleave(rows, counts, output_size=kept_ids.numel())


def _kept(x, settings, csr, r0, r1):
    if csr is not None:
        return KeptSet(x, settings.temperature, csr, r0, r1)
    return Filtered(x, *[v[r0:r1] if isinstance(v, torch.Tensor) else v for v in settings])


class _NativeLinearProcessed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, safe_ids, valid, bad, gemm, settings, csr, return_entropy,
                batch_invariant, record):
        n, vocab = hidden.shape[0], weight.shape[0]
        cd = compute_dtype(hidden.dtype)
        out = torch.zeros(n, dtype=cd, device=hidden.device)
        ent = torch.zeros(n, dtype=cd, device=hidden.device) if return_entropy else None
        bad_all = bad.clone()
        step = chunk_rows(vocab)
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            f = _kept(gemm(hidden[r0:r1]), settings, csr, r0, r1)
            o, e, b = processed_values(f, safe_ids[r0:r1], valid[r0:r1], bad[r0:r1], return_entropy)
            out[r0:r1], bad_all[r0:r1] = o, b
            if return_entropy:
                ent[r0:r1] = e
        ctx.save_for_backward(hidden, weight, bias, safe_ids, valid, bad_all)
        ctx.gemm, ctx.settings, ctx.csr, ctx.record, ctx.batch_invariant = gemm, settings, csr, record, batch_invariant
        ctx.set_materialize_grads(False)
        return out, ent

    @staticmethod
    @second_order.refused("linear_logp.backward")
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, bias, safe_ids, valid, bad = ctx.saved_tensors
        requested, status, reason = ctx.record
        dispatch.record("linear_logp.backward", requested, "native", status, reason)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        none = (None,) * 9
        with op_range("op.linear_logp.backward"):
            n, vocab = hidden.shape[0], weight.shape[0]
            cd = compute_dtype(hidden.dtype)
            w = weight.to(cd)
            dh = torch.zeros(hidden.shape, dtype=cd, device=hidden.device) if need_h else None
            w_bi = bi_aligned(w, vocab) if need_h and ctx.batch_invariant else None  # once, not per chunk
            dw = torch.zeros(weight.shape, dtype=cd, device=weight.device) if need_w else None
            db = torch.zeros(vocab, dtype=cd, device=weight.device) if need_b else None
            if grad_logp is None and grad_ent is None:
                n = 0  # nothing reaches the outputs: zero gradients
            step = chunk_rows(vocab)
            for r0 in range(0, n, step):
                r1 = min(n, r0 + step)
                f = _kept(ctx.gemm(hidden[r0:r1]), ctx.settings, ctx.csr, r0, r1)  # the forward's kept set
                g = processed_grad(f, safe_ids[r0:r1], valid[r0:r1], bad[r0:r1],
                                   None if grad_logp is None else grad_logp[r0:r1],
                                   None if grad_ent is None else grad_ent[r0:r1])
                if need_h:  # batch_invariant: one dH GEMM shape per call, every row aligned alike
                    with batch_invariant_blas(cd, g.device, ctx.batch_invariant):
                        dh[r0:r1] = bi_matmul(g, w_bi, step, w.shape[1]) if ctx.batch_invariant else g @ w
                if need_w:
                    dw += g.t() @ hidden[r0:r1].to(cd)
                if need_b:
                    db += g.sum(0)
            cast = lambda a, like: a.to(like.dtype) if a is not None else None  # noqa: E731
            return (cast(dh, hidden), cast(dw, weight), cast(db, weight) if bias is not None else None) + none


def linear_logp_processed_native(hidden, weight, token_ids, *, bias, gemm, settings, csr, ignore_index,
                                 return_entropy, batch_invariant=False, requested="native", fallback_reason="",
                                 keep_dtype=False):
    """Processed log-probs (and the filtered entropy) of validated inputs: (logp, entropy or None), float32 (float64
    inputs with ``keep_dtype``). ``gemm(rows [n, H]) -> [n, V]`` the chunk's logits; ``settings`` the normalised
    filters (``validate.RowSettings``); ``csr`` None or (kept ids, row of each entry) from ``csr_rows``. On CUDA a
    bad id or per-row setting gives NaN and goes to the device error record (no host sync)."""
    with op_range("op.linear_logp.forward"):
        lead, vocab = hidden.shape[:-1], weight.shape[0]
        rows = hidden.reshape(-1, hidden.shape[-1])
        ids = token_ids.reshape(-1).long()
        valid = ids != ignore_index
        bad_id = valid & ((ids < 0) | (ids >= vocab))
        faults = row_faults(settings)
        bad = bad_id if faults is None else bad_id | (valid & faults[0])
        safe = torch.where(valid & ~bad_id, ids, torch.zeros_like(ids))
        valid = valid & ~bad
        status = "fallback" if fallback_reason else "native"
        out, ent = _NativeLinearProcessed.apply(rows, weight, bias, safe, valid, bad, gemm, settings, csr,
                                                bool(return_entropy), bool(batch_invariant),
                                                (requested, status, fallback_reason))
        if hidden.device.type == "cuda":
            address, seq, sync = errors.begin("linear_logp.forward", hidden.device, token_ids.shape, vocab)
            if faults is not None:
                errors.note_native(errors.ERR_BAD_ARG, seq, address, hidden.device, faults[0], faults[1])
            errors.note_native(errors.ERR_LOGP_BAD_ID, seq, address, hidden.device, bad_id, ids)
            errors.after_call(hidden.device, sync)
        if not keep_dtype:
            out = out.float()
            ent = ent.float() if ent is not None else None
        return out.view(lead), (ent.view(lead) if ent is not None else None)
