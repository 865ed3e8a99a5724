"""The fused CUDA backend of rlkernel.sample: the fake kernel and the call the dispatcher makes.

The op (schema and CUDA impl in csrc/sampling_op.cpp, kernels in csrc/include/rlkernel/sampling_kernels.cuh):
``torch.ops.rlkernel.sample(logits[N, V], temperature, top_k, top_p, generator=None, error_record=0, error_seq=0)
-> ids[N] int64``. A row without a distribution (a NaN, no logit above -inf, or at T > 0 a +inf logit) gets id -1
and is reported to the device error record at ``error_record`` under call ``error_seq`` (rlkernel.errors).

The draw is a Gumbel race over the kept set with Philox noise keyed by (generator seed, offset, row, token id):
the same distribution as the native path, not the same ids for a seed. The log-probs of ``return_logprobs``
come from the fused logp forward (``logp_fused``) on the drawn ids, so they are the training path's numbers bit for
bit; that kernel opens its own ``op.logp.forward`` range (after ``op.sample``) but leaves no dispatch record: the
log-probs are part of the sample call.
"""
from __future__ import annotations

import torch

from rlkernel import _ext, errors
from rlkernel.ops.logp_fused import as_rows, logp_fused

_registered = False
_SAMPLE = None  # torch.ops.rlkernel.sample.default once registered


def _sample_fake(logits, temperature, top_k, top_p, generator=None, error_record=0, error_seq=0):
    return torch.empty((logits.shape[0],), dtype=torch.int64, device=logits.device)


def ensure_registered() -> None:
    """Load rlkernel._C (raises rlkernel._ext.ExtensionNotBuilt) and register the fake kernel once."""
    global _registered
    if _registered:
        return
    _ext.load()
    torch.library.register_fake("rlkernel::sample")(_sample_fake)
    global _SAMPLE
    _SAMPLE = torch.ops.rlkernel.sample.default  # the overload itself: no packet lookup per call
    _registered = True


def sample_fused(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float,
                 generator: torch.Generator | None, return_logprobs: bool):
    """Fused draw for validated CUDA logits; returns (ids int64 of shape logits.shape[:-1], float32 log-probs
    under softmax(logits / T) (T = 1 when T = 0), or None). No host sync."""
    if not _registered:
        ensure_registered()
    lead = logits.shape[:-1]
    rows = as_rows(logits)
    address, seq, sync = errors.begin("sample", logits.device, lead, logits.shape[-1])
    ids = _SAMPLE(rows, temperature, top_k, top_p, generator, address, seq).view(lead)
    lp = None
    if return_logprobs:
        # the fused logp forward itself (same kernels, same bits as rlkernel.logp), without a dispatch record of its
        # own: the log-probs are part of this sample call, and so are their errors (a row without a distribution
        # has id -1 here, reported under the sample call's number, where the sampler already put the same entry)
        with torch.no_grad():
            lp, _ = logp_fused(logits, ids, temperature=temperature if temperature > 0 else 1.0, ignore_index=-100,
                               return_entropy=False, inplace_backward=False,
                               report_as=(address, seq, errors.ERR_SAMPLE_NO_DIST))
    errors.after_call(logits.device, sync)
    return ids, lp


try:  # register as soon as the extension is there, so torch.compile and opcheck see the fake kernel
    ensure_registered()
except _ext.ExtensionNotBuilt:  # not built: rlkernel.sample then records a fallback with _ext's reason
    pass
