"""The native (reference) backend of rlkernel.sample: the exact filtered law, in plain PyTorch, every row with its
own settings in one vectorised call (no loop over rows)."""
from __future__ import annotations

import torch

from rlkernel import errors
from rlkernel.nvtx_ranges import op_range
from rlkernel.ops.native.filters import Filtered, seeded_exponentials
from rlkernel.ops.native.logp import native_logp_values
from rlkernel.ops.native.logp_processed import processed_logp_values
from rlkernel.validate import RowSettings, no_distribution_error, row_faults


def _draw(rows, settings: RowSettings, generator, seed, offset):
    """(ids, rows without a distribution). The draw is an exponential race over the kept set, argmax of p_i / E_i
    with E_i ~ Exp(1), which picks i with probability proportional to p_i and needs no host sync
    (torch.multinomial reads back to the host on CUDA). E comes from ``generator``, or, with ``seed``, from a
    counter-based generator keyed by (the row's seed, its offset, the token id): then a row's draw depends on
    nothing but its own logits and settings. A row without a distribution gets -1: on CPU it raises here; on CUDA
    the caller reports it to the device error record."""
    n, vocab = rows.shape
    f = Filtered(rows, *settings)
    bad = f.no_distribution()
    if isinstance(settings.temperature, float) and settings.temperature == 0:
        ids = f.top  # greedy: no noise drawn (the generator's state does not move)
    else:
        if seed is None:
            race = torch.empty_like(f.e).exponential_(generator=generator)
            # a token outside the kept set never wins: -1 is below every p / E >= 0
            score = torch.where(f.kept, f.e / race, torch.full_like(f.e, -1.0))
            ids = score.argmax(dim=-1)
        else:
            # noise only where it can matter: the sorted positions up to the last kept one of any row (on CPU,
            # where reading that length costs no sync; on CUDA the whole row). The noise is keyed by token id, so
            # the winner is the same whatever this length is.
            limit = vocab
            if rows.device.type == "cpu" and not torch.compiler.is_compiling():
                rank = torch.arange(vocab).view(1, vocab)
                limit = int(torch.where(f.kept_sorted, rank, 0).amax()) + 1
            tokens = f.order[:, :limit]
            race = seeded_exponentials(seed, offset, tokens, f.e.dtype)
            e = f.e.gather(-1, tokens)
            score = torch.where(f.kept_sorted[:, :limit], e / race, torch.full_like(e, -1.0))
            ids = tokens.gather(-1, score.argmax(dim=-1, keepdim=True)).view(n)
        ids = torch.where(f.greedy, f.top, ids)
    if rows.device.type == "cpu" and not torch.compiler.is_compiling() and bool(bad.any()):  # compiled: -1 only
        raise no_distribution_error(int(bad.nonzero()[0]))
    return ids, bad


def _raw_settings(settings: RowSettings) -> RowSettings:
    """The unfiltered distribution of ``return_logprobs=True``: softmax(logits / T), T = 1 for T = 0 rows."""
    t = settings.temperature
    if isinstance(t, torch.Tensor):
        t = torch.where(t > 0, t, torch.ones_like(t))
    else:
        t = t if t > 0 else 1.0
    return RowSettings(t, 0, 1.0, 0.0)


def sample_native(logits, *, settings: RowSettings | None = None, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                  generator=None, seed=None, offset=0, return_logprobs=False):
    """Draw one id per row of validated inputs: (int64 ids of shape logits.shape[:-1], float32 log-probs or None).
    The filters come as ``settings`` (rlkernel.validate.RowSettings) or as the four keywords (numbers, or [N]
    tensors).

    The log-probs are computed by logp's native code (the arithmetic of ``rlkernel.logp(backend="native")`` with
    the same arguments: ``return_logprobs=True`` the unfiltered one, ``"processed"`` the filtered one) inside this
    op's ``op.sample`` range: they are part of the sampler's work, not a separate logp call, so a trace or a
    dispatch history shows no logp op for them."""
    if settings is None:
        settings = RowSettings(temperature, top_k, top_p, min_p)
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    rows = logits.reshape(lead.numel(), vocab)
    with op_range("op.sample"):
        if rows.shape[0] == 0:
            ids = torch.empty(0, dtype=torch.long, device=logits.device)
        else:
            ids, bad = _draw(rows, settings, generator, seed, offset)
            faults = row_faults(settings)  # CPU tensors were checked by rlkernel.validate
            if faults is not None:
                bad = bad | faults[0]
            ids = torch.where(bad, torch.full_like(ids, -1), ids)
            if rows.device.type == "cuda":
                address, seq, sync = errors.begin("sample", logits.device, lead, vocab)
                if faults is not None:
                    errors.note_native(errors.ERR_BAD_ARG, seq, address, logits.device, faults[0], faults[1])
                errors.note_native(errors.ERR_SAMPLE_NO_DIST, seq, address, logits.device, bad, None)
                errors.after_call(logits.device, sync)
        lp = None
        if return_logprobs == "processed" and settings.filtered(vocab):
            lp = processed_logp_values(rows, ids, settings).reshape(lead)
        elif return_logprobs:
            raw = _raw_settings(settings)
            if isinstance(raw.temperature, torch.Tensor):  # what rlkernel.logp does with a per-row temperature
                lp = processed_logp_values(rows, ids, raw).reshape(lead)
            else:
                lp = native_logp_values(rows, ids, raw.temperature).reshape(lead)
    return ids.reshape(lead), lp
