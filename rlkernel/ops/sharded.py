"""Sharded LM-head weights for rlkernel.linear_logp and rlkernel.linear_logp_loss.

- **FSDP2 / DTensor:** a ``DTensor`` weight or bias is gathered once per call (``full_tensor()``, differentiable: the
  gradient goes back to the shards through DTensor's own autograd). The gathered tensor is what a recomputing
  backward saves, so there is no second gather.
- **DeepSpeed ZeRO-3:** a partitioned parameter (``ds_status`` not AVAILABLE; checked only where DeepSpeed is
  importable) is gathered by ``deepspeed.zero.GatheredParameters`` around the forward, and again in
  ``linear_logp``'s recomputing backward (``regathered``), where the saved parameter is an empty shard otherwise.
  ``linear_logp_loss`` computes its gradients in its forward and needs no second gather to compute them; its
  backward only makes the parameter whole again (``regathered``: communication, no compute) because autograd
  accumulates the whole gradient into the parameter after the backward returns, which an empty shard refuses.
  Gradients are returned whole (``[V, H]``), as DeepSpeed's own ZeRO-3 linear returns them; ZeRO's gradient hooks
  reduce-scatter them.
"""
from __future__ import annotations

import contextlib
import importlib.util


def full(t):
    """A DTensor gathered whole (differentiable), anything else as is."""
    if t is None:
        return None
    full_tensor = getattr(t, "full_tensor", None)
    if full_tensor is not None and type(t).__name__ == "DTensor":
        return full_tensor()
    return t


def _zero_available():
    if importlib.util.find_spec("deepspeed") is None:
        return None
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return ZeroParamStatus.AVAILABLE


def zero3_partitioned(*params) -> tuple:
    """The ZeRO-3 parameters among ``params`` that are partitioned now (deduplicated by identity)."""
    if not any(p is not None and hasattr(p, "ds_status") for p in params):
        return ()
    available = _zero_available()
    if available is None:
        return ()
    found = {id(p): p for p in params if p is not None and hasattr(p, "ds_status") and p.ds_status != available}
    return tuple(found.values())


def gathered(params: tuple):
    """Gather these ZeRO-3 parameters for the block (a no-op for none)."""
    if not params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(params))


@contextlib.contextmanager
def regathered(params: tuple):
    """The backward's gather of those of ``params`` partitioned again by then: ``param.all_gather()`` and no release
    on exit, as DeepSpeed's own gather of an external parameter does. The gradient is accumulated into the parameter
    after the backward returns, which needs it whole (a release here would leave AccumulateGrad an empty shard);
    DeepSpeed releases it with its other leftovers after the backward / at the step."""
    for p in zero3_partitioned(*params):
        p.all_gather()
    yield
