"""rlkernel.sample: temperature / top-k / top-p / min-p sampling with per-row settings and seeds, on the fused CUDA
path or the native one."""
from __future__ import annotations

import torch

from rlkernel import dispatch
from rlkernel.ops.fused.sampling import sample_fused
from rlkernel.ops.native.sampling import sample_native
from rlkernel.validate import check_return_logprobs, check_sample_args


def sample(logits: torch.Tensor, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
           generator: torch.Generator | None = None, seed=None, offset=0, return_logprobs=False,
           backend: str = "auto", require_fused: bool = False):
    """Draw one token id per row of ``logits`` (int64, shape ``logits.shape[:-1]``).

    ``temperature``, ``top_k``, ``top_p``, ``min_p``: each a Python number or a tensor of shape
    ``logits.shape[:-1]`` (one value per row; a 0-dim tensor broadcasts). The kept set of a row: on
    p = softmax(logits / T), the top_k most probable (0 = all; ties by lower id), then the smallest prefix of those
    whose renormalised mass reaches top_p, then the tokens with p >= min_p * max(p); the draw is from p renormalised
    over it. T = 0 is argmax (lowest id among ties).
    ``seed`` (an int, or int64 per row) with ``offset`` (an int, or int64 per row, e.g. the decode position) replaces
    ``generator``: a row's draw is then a pure function of its logits, settings, seed and offset, the same alone or
    in any batch. ``return_logprobs=True`` also returns the drawn token's log-prob under the unfiltered
    softmax(logits / T) (T = 1 when T = 0); ``"processed"`` under the filtered, renormalised distribution it was
    drawn from; both what ``rlkernel.logp`` gives on the same backend with the same arguments, bit for bit but for
    the fused ``True``, which comes from the sampler's own pass and keeps a stated bound of it (bit for bit on its
    whole-row path with a number T; docs/contracts.md, section 1).
    On CUDA nothing here waits for the GPU: a row without a distribution, or with a per-row setting out of range,
    gets id -1 (log-prob NaN) and goes to the device error record (``rlkernel.check_errors``). See
    docs/contracts.md, section 1.
    """
    settings, seed, offset = check_sample_args(logits, temperature, top_k, top_p, generator, min_p=min_p, seed=seed,
                                               offset=offset)
    mode = check_return_logprobs(return_logprobs)
    rec = dispatch.resolve("sample", backend, require_fused, logits.device, logits.dtype)
    if rec.status == "fused":
        # unfiltered, the processed law is the plain one: the raw log-prob (True), as rlkernel.logp takes its plain
        # kernel for it (both come out of the sampler's own pass; the filtered one bitwise the processed kernel's)
        fused_mode = True if mode == "processed" and not settings.filtered(logits.shape[-1]) else mode
        ids, lp = sample_fused(logits, temperature=settings.temperature, top_k=settings.top_k,
                               top_p=settings.top_p, min_p=settings.min_p, generator=generator, seed=seed,
                               offset=offset, return_logprobs=fused_mode)
    else:
        with torch.no_grad():
            ids, lp = sample_native(logits, settings=settings, generator=generator, seed=seed, offset=offset,
                                    return_logprobs=mode)
    return (ids, lp) if mode else ids
