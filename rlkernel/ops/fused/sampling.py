"""The fused CUDA backend of rlkernel.sample: the fake kernel and the call the dispatcher makes.

The op (schema and CUDA impl in csrc/sampling_op.cpp, kernels in csrc/include/rlkernel/sampling_kernels.cuh):
``torch.ops.rlkernel.sample(logits[N, V], temperature, top_k, top_p, generator=None, error_record=0, error_seq=0,
min_p=0.0, temperature_rows=None, top_k_rows=None, top_p_rows=None, min_p_rows=None, seeded=False, seed=0,
seed_rows=None, offset=0, offset_rows=None) -> ids[N] int64``, and ``torch.ops.rlkernel.sample_processed`` (the same
arguments, then ``raw=False``) ``-> (ids[N] int64, logprobs[N] float32)``: the same draw, and each drawn id's processed
log-prob (``raw=True``: its unfiltered one) from the same kernels in the same pass over the logits. A ``*_rows`` tensor
([N], float32; top_k, seeds and offsets int64) replaces its scalar: its values are read by the kernels only (the launch
is chosen without them). A row without a distribution (a NaN, no logit above -inf, or at T > 0 a +inf logit) gets id -1
and is reported to the device error record at ``error_record`` under call ``error_seq`` (rlkernel.errors); a row whose
per-row setting is out of range gets id -1 and an ``ERR_BAD_ARG`` entry naming the argument.

The draw is a Gumbel race over the kept set with Philox noise keyed by (generator seed, offset, row, token id), or,
with ``seeded``, by (the row's seed, the row's offset, token id) only: then a row's id does not depend on the batch
it is in. The same distribution as the native path, not the same ids for a seed. ``return_logprobs="processed"``
takes ``sample_processed``: the sampler's kernels sum the kept set's mass in the pass that draws, by the processed
logp forward's own integer code, so the log-probs are ``logp_processed_fused``'s with the same settings bit for bit,
inside ``op.sample`` and with no second kernel over the logits. ``return_logprobs=True`` (the unfiltered log-prob)
takes ``sample_processed(..., raw=True)``: the same kernels also reduce each row to its max and sum of exponentials
(the candidates kernel per chunk, merged in select; the whole-row path by the logp forward's own row reduction), so
no second kernel reads the logits; within a stated bound of ``rlkernel.logp`` rather than bitwise on the fast path
(docs/contracts.md, section 1). Either way no dispatch record of their own: the log-probs are part of the sample call.
"""
from __future__ import annotations

import torch

from rlkernel import _ext, errors
from rlkernel.ops.rows import as_lead, as_rows, eager_entry_ok, int64_arg, split_setting

_registered = False
_SAMPLE = None  # torch.ops.rlkernel.sample.default once registered
_SAMPLE_EAGER = None  # rlkernel._C.sample_eager: the same C++ without torch's op dispatcher (csrc/python_module.cpp)
_SAMPLE_PROCESSED = None  # torch.ops.rlkernel.sample_processed.default
_SAMPLE_PROCESSED_EAGER = None  # rlkernel._C.sample_processed_eager


def _sample_fake(logits, temperature, top_k, top_p, generator=None, error_record=0, error_seq=0, min_p=0.0,
                 temperature_rows=None, top_k_rows=None, top_p_rows=None, min_p_rows=None, seeded=False, seed=0,
                 seed_rows=None, offset=0, offset_rows=None):
    return torch.empty((logits.shape[0],), dtype=torch.int64, device=logits.device)


def _sample_processed_fake(logits, temperature, top_k, top_p, generator=None, error_record=0, error_seq=0,
                           min_p=0.0, temperature_rows=None, top_k_rows=None, top_p_rows=None, min_p_rows=None,
                           seeded=False, seed=0, seed_rows=None, offset=0, offset_rows=None, raw=False):
    n = logits.shape[0]
    return (torch.empty((n,), dtype=torch.int64, device=logits.device),
            torch.empty((n,), dtype=torch.float32, device=logits.device))


def ensure_registered() -> None:
    """Load rlkernel._C (raises rlkernel._ext.ExtensionNotBuilt) and register the fake kernel once."""
    global _registered
    if _registered:
        return
    module = _ext.load()
    torch.library.register_fake("rlkernel::sample")(_sample_fake)
    torch.library.register_fake("rlkernel::sample_processed")(_sample_processed_fake)
    global _SAMPLE, _SAMPLE_EAGER, _SAMPLE_PROCESSED, _SAMPLE_PROCESSED_EAGER
    _SAMPLE = torch.ops.rlkernel.sample.default  # the overload itself: no packet lookup per call
    _SAMPLE_EAGER = module.sample_eager
    _SAMPLE_PROCESSED = torch.ops.rlkernel.sample_processed.default
    _SAMPLE_PROCESSED_EAGER = module.sample_processed_eager
    _registered = True


def sample_fused(logits: torch.Tensor, *, temperature, top_k, top_p, min_p=0.0, generator=None, seed=None, offset=0,
                 return_logprobs=False):
    """Fused draw for validated CUDA logits; returns (ids int64 of shape logits.shape[:-1], float32 log-probs or
    None). Each setting is a Python number or a CUDA tensor with one value per row; ``seed`` (an int or int64 per
    row) with ``offset`` replaces ``generator``. ``return_logprobs``: False, True (raw: under softmax(logits / T),
    T = 1 when T = 0; within the bound of docs/contracts.md, section 1, of ``rlkernel.logp``) or "processed" (under
    the filtered law, bitwise ``logp_processed_fused``), both from the sampler's own pass. No host sync."""
    if not _registered:
        ensure_registered()
    lead = logits.shape[:-1]
    rows = as_rows(logits)
    t, t_rows = split_setting(temperature, 1.0, torch.float32)
    k, k_rows = split_setting(top_k, 0, torch.int64)
    p, p_rows = split_setting(top_p, 1.0, torch.float32)
    mp, mp_rows = split_setting(min_p, 0.0, torch.float32)
    seeded = seed is not None
    s, s_rows = split_setting(seed, 0, torch.int64) if seeded else (0, None)
    o, o_rows = split_setting(offset, 0, torch.int64)
    address, seq, sync = errors.begin("sample", logits.device, lead, logits.shape[-1])
    # no gradient ever: the extension's own entry when nothing must see the op (rlkernel.ops.rows), else the
    # registered op; the same C++ either way. With log-probs (processed, or raw for True) the draw and its log-probs
    # come from one pass of the kernels: no second kernel over the logits.
    eager = eager_entry_ok(rows, t_rows, k_rows, p_rows, mp_rows, s_rows, o_rows)
    args = (rows, float(t), int(k), float(p), None if seeded else generator, address, seq, float(mp), t_rows, k_rows,
            p_rows, mp_rows, seeded, int64_arg(s), s_rows, int64_arg(o), o_rows)
    if return_logprobs:
        op = _SAMPLE_PROCESSED_EAGER if eager else _SAMPLE_PROCESSED
        ids, lp = op(*args, return_logprobs != "processed")  # raw: the unfiltered log-prob
        ids, lp = as_lead(ids, lead), as_lead(lp, lead)
    else:
        ids, lp = as_lead((_SAMPLE_EAGER if eager else _SAMPLE)(*args), lead), None
    errors.after_call(logits.device, sync)
    return ids, lp


# register as soon as the extension is loaded (now for an in-tree build, else after the first call loads or builds
# it), so torch.compile and opcheck see the fake kernel; importing never builds
_ext.when_loaded(ensure_registered)
