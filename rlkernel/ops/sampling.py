"""rlkernel.sample: top-k / top-p / temperature sampling, on the fused CUDA path or the native one."""
from __future__ import annotations

import torch

from rlkernel import dispatch
from rlkernel.ops.sampling_fused import sample_fused
from rlkernel.ops.sampling_native import sample_native
from rlkernel.validate import check_sample_args


def sample(logits: torch.Tensor, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None, return_logprobs: bool = False, backend: str = "auto",
           require_fused: bool = False):
    """Draw one token id per row of ``logits`` (int64, shape ``logits.shape[:-1]``).

    Order: p = softmax(logits / T); keep the top_k most probable (0 = all; ties by lower id); renormalise; keep
    the smallest prefix reaching mass top_p; renormalise; draw with ``generator``. T = 0 is argmax.
    ``return_logprobs=True`` also returns the drawn token's log-prob under the unfiltered softmax(logits / T)
    (T = 1 when T = 0), computed by ``rlkernel.logp`` on the same backend, so rollout and training agree.
    On CUDA nothing here waits for the GPU: a row without a distribution gets id -1 (log-prob NaN) and goes to the
    device error record (``rlkernel.check_errors``).
    """
    check_sample_args(logits, temperature, top_k, top_p, generator)
    top_k = min(int(top_k), logits.shape[-1])  # k >= V keeps every token, as 0 does
    rec = dispatch.resolve("sample", backend, require_fused, logits.device, logits.dtype)
    if rec.status == "fused":
        ids, lp = sample_fused(logits, temperature=float(temperature), top_k=top_k, top_p=float(top_p),
                               generator=generator, return_logprobs=bool(return_logprobs))
    else:
        with torch.no_grad():
            ids, lp = sample_native(logits, temperature=float(temperature), top_k=top_k, top_p=float(top_p),
                                    generator=generator, return_logprobs=bool(return_logprobs))
    return (ids, lp) if return_logprobs else ids
