"""Numeric conventions several modules share (the workload registry, the GRPO trainer, the CLIs)."""
from __future__ import annotations

import torch

# The logits dtypes every workload, CLI and example accepts, by the names their --dtype flags take.
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# (atol, rtol) of fused vs native log-probs, the same for every logits dtype: both paths upcast the same rounded
# inputs and accumulate in float32, so they differ only in summation order, a few float32 ulps of the
# log-sum-exp (|lse| ~ log V + max logit, i.e. ~10-30 here).
LOGP_TOLERANCE = (1e-4, 1e-5)
