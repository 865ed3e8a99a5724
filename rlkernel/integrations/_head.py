"""What every integration checks before it hands an LM head to rlkernel.linear_logp / linear_logp_loss.

The ops take one dtype for hidden states, weight and bias and do not follow autocast, and they read the weight as
a plain tensor (docs/contracts.md, section 1). A call outside that goes back to the framework's own code with the
reason returned here, until the ops grow mixed precision and sharded weights.
"""
from __future__ import annotations

import torch


def compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype the framework's head would run its GEMM in: autocast's where it is on, else the hidden states'."""
    kind = hidden.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else hidden.dtype


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def unsupported_reason(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
                       zero3_gathered: bool = False) -> str | None:
    """Why rlkernel's ops cannot compute this head as the framework does; None when they can. ``zero3_gathered``:
    the call runs inside the framework's ZeRO-3 gather of the head and computes every gradient there
    (``linear_logp_loss``), so a ZeRO-3 parameter is a plain, gathered weight for it."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed support
        DTensor = ()
    for what, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if isinstance(t, DTensor):
            return f"the LM head {what} is a DTensor (FSDP2 / tensor parallel): sharded weights are not supported"
        if hasattr(t, "ds_id") and not zero3_gathered:
            # linear_logp's backward recomputes from the saved weight, outside the framework's gather
            return f"the LM head {what} is a DeepSpeed ZeRO-3 parameter: sharded weights are not supported"
    if weight.device != hidden.device or (bias is not None and bias.device != hidden.device):
        return f"hidden states on {hidden.device}, the LM head on {weight.device} (a model split across devices)"
    dtypes = {"hidden": hidden.dtype, "weight": weight.dtype} | ({"bias": bias.dtype} if bias is not None else {})
    compute = compute_dtype(hidden)
    if any(d != compute for d in dtypes.values()):
        named = ", ".join(f"{k} {_name(d)}" for k, d in dtypes.items())
        return f"mixed dtypes ({named}, compute {_name(compute)}): the ops take one dtype"
    return None


def autocast_off(hidden: torch.Tensor):
    """A context without autocast on the hidden states' device: the op then runs forward and backward in the one
    dtype its inputs have, which unsupported_reason made the compute dtype."""
    return torch.autocast(hidden.device.type, enabled=False)
