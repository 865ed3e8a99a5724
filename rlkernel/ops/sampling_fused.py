"""The fused CUDA backend of rlkernel.sample: the fake kernel and the call the dispatcher makes.

The op (schema and CUDA impl in csrc/sampling_op.cpp, kernels in csrc/include/rlkernel/sampling_kernels.cuh):
``torch.ops.rlkernel.sample(logits[N, V], temperature, top_k, top_p, generator=None) -> (ids[N] int64,
first_bad[1] int32)``. ``first_bad`` is the first row without a distribution (a NaN, no logit above -inf, or at
T > 0 a +inf logit), else ``NO_BAD_ROW``; such a row's id is -1.

The draw is a Gumbel race over the kept set with Philox noise keyed by (generator seed, offset, row, token id):
the same distribution as the native path, not the same ids for a seed. The log-probs of ``return_logprobs``
come from the fused logp forward (``logp_fused``) on the drawn ids, so they are the training path's numbers bit for
bit; that kernel opens its own ``op.logp.forward`` range (after ``op.sample``) but leaves no dispatch record: the
log-probs are part of the sample call.
"""
from __future__ import annotations

import torch

from rlkernel import _ext
from rlkernel.ops.logp_fused import as_rows
from rlkernel.validate import validation_enabled

NO_BAD_ROW = 0x7F7F7F7F  # kNoBadRow of csrc/include/rlkernel/sampling_api.cuh (the bytes of a 0x7F memset)

_registered = False


def _sample_fake(logits, temperature, top_k, top_p, generator=None):
    return (torch.empty((logits.shape[0],), dtype=torch.int64, device=logits.device),
            torch.empty((1,), dtype=torch.int32, device=logits.device))


def ensure_registered() -> None:
    """Load rlkernel._C (raises rlkernel._ext.ExtensionNotBuilt) and register the fake kernel once."""
    global _registered
    if _registered:
        return
    _ext.load()
    torch.library.register_fake("rlkernel::sample")(_sample_fake)
    _registered = True


def sample_fused(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float,
                 generator: torch.Generator | None, return_logprobs: bool):
    """Fused draw for validated CUDA logits; returns (ids int64 of shape logits.shape[:-1], float32 log-probs
    under softmax(logits / T) (T = 1 when T = 0), or None)."""
    if not _registered:
        ensure_registered()
    lead = logits.shape[:-1]
    rows = as_rows(logits)
    ids, first_bad = torch.ops.rlkernel.sample(rows, float(temperature), int(top_k), float(top_p), generator)
    # One 4-byte copy after the kernels, as the native path raises: skipped while torch.compile traces, inside
    # CUDA-graph capture and with RLKERNEL_VALIDATE=0 (the bad rows' ids are -1 then).
    if rows.shape[0] and validation_enabled():
        first = int(first_bad.item())
        if first != NO_BAD_ROW:
            raise ValueError(f"sample: row {first} has no finite probabilities (all -inf or NaN logits)")
    ids = ids.view(lead)
    if not return_logprobs:
        return ids, None
    from rlkernel.ops.logp_fused import logp_fused

    # the fused logp forward itself (same kernels, same bits as rlkernel.logp), without a dispatch record of its
    # own: the log-probs are part of this sample call, as on the native path
    with torch.no_grad():
        lp, _ = logp_fused(logits, ids, temperature=float(temperature) if temperature > 0 else 1.0,
                           ignore_index=-100, return_entropy=False, inplace_backward=False)
    return ids, lp


try:  # register as soon as the extension is there, so torch.compile and opcheck see the fake kernel
    ensure_registered()
except Exception:  # not built: rlkernel.sample then records a fallback with _ext's reason
    pass
