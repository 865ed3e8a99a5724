"""rlkernel.integrations.verl: verl's fused LM head and its log-prob / entropy helpers through rlkernel.

- ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy``, the LM head of verl's ``use_fused_kernels``
  path (``fused_kernels_backend="triton"``: ``forward_with_triton_backend`` imports it at each call, inside the
  model's forward, so FSDP's hooks still run): ``rlkernel.linear_logp`` with ``return_entropy=True``, float32
  ``(log_probs, entropy)`` of shape ``hidden.shape[:-1]`` (as verl's torch backend shapes them; verl's Triton
  kernel returns them flat, which its rmpad path squeezes to the same). Back to verl's kernel, with the reason
  recorded (``integrations.verl`` fallback): a tensor-parallel group of more than one rank (vocab-parallel heads are
  not supported), a reduction other than ``"none"``, a temperature tensor, mixed dtypes or an autocast
  dtype other than the inputs', a DTensor / ZeRO-3 weight.
- ``verl.utils.torch_functional.logprobs_from_logits`` (``inplace_backward`` kept: the fused backward may write the
  gradient over the logits, as verl's flash-attn path does) and ``entropy_from_logits``: ``rlkernel.logp``, the
  log-probs in float32 (as verl's flash-attn path gives them), the entropy in the logits' dtype (as verl's own),
  the entropy scoring a dummy id 0 alongside. Also the same names in every ``verl`` module already imported that
  bound them by name (its engines do); a module imported later binds the replacements. Patch before building the
  engine: it wraps ``entropy_from_logits`` in ``torch.compile`` when it is built.

Phases (contract 3): none. Each patched function runs in more than one standard phase (the actor's old log-probs,
the reference model's log-probs and the update's training forward all go through the same head), so no phase
range fits it; ``apply(phases=True)``, the default of every integration, adds none here. Mark verl's phases around
its calls with ``rlkernel.phase``.
"""
from __future__ import annotations

import importlib

import torch

import rlkernel
from rlkernel import dispatch
from rlkernel.integrations import _head
from rlkernel.integrations._patch import Patch, ProcessPatch, bound_by_name, check_options, check_version

OP = "integrations.verl"
MINIMUM, BELOW = (0, 9), (0, 10)
_slot = ProcessPatch("rlkernel.integrations.verl")


def head_fallback_reason(hidden, weight, temperature, reduction, dist_process_group) -> str | None:
    """Why this call of verl's linear_cross_entropy goes back to verl; None when rlkernel.linear_logp computes it."""
    if dist_process_group is not None:
        import torch.distributed as dist

        ranks = dist.get_world_size(dist_process_group)
        if ranks > 1:
            return f"a tensor-parallel group of {ranks} ranks: vocab-parallel heads are not supported"
    if str(reduction).lower() != "none":
        return f"reduction={reduction!r} not supported (rlkernel returns per-token values: 'none')"
    if torch.is_tensor(temperature):
        return "a temperature tensor is not supported (per-token temperatures: not yet)"
    return _head.unsupported_reason(hidden, weight, None)


def linear_cross_entropy(hidden, weight, labels, temperature=1.0, reduction="none", dist_process_group=None):
    """verl's ``linear_cross_entropy`` by rlkernel.linear_logp: ``(log_probs, entropy)``."""
    verl_own = _slot.originals["linear_cross_entropy"]
    if not _slot.active:  # bound by a verl module while the patch was active, called after undo(): verl's own
        return verl_own(hidden, weight, labels, temperature, reduction, dist_process_group)
    reason = head_fallback_reason(hidden, weight, temperature, reduction, dist_process_group)
    opts = _slot.options
    if reason is not None:
        dispatch.framework_fallback(OP, reason, **opts)
        return verl_own(hidden, weight, labels, temperature, reduction, dist_process_group)
    with _head.autocast_off(hidden):
        return rlkernel.linear_logp(hidden, weight, labels.to(torch.int64), temperature=temperature,
                                    return_entropy=True, **opts)


def logprobs_from_logits(logits, labels, inplace_backward=True):
    """verl's ``logprobs_from_logits`` by rlkernel.logp: float32, shape ``logits.shape[:-1]``."""
    if not _slot.active:
        return _slot.originals["logprobs_from_logits"](logits, labels, inplace_backward)
    return rlkernel.logp(logits, labels, inplace_backward=bool(inplace_backward), **_slot.options)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """verl's ``entropy_from_logits`` by rlkernel.logp's entropy (a dummy id 0 scored alongside)."""
    if not _slot.active:
        return _slot.originals["entropy_from_logits"](logits)
    ids = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    _, entropy = rlkernel.logp(logits, ids, return_entropy=True, **_slot.options)
    return entropy.to(logits.dtype)


# (module, name) -> replacement; modules that bound the name from its module are patched too
REPLACEMENTS = {("verl.utils.kernel.linear_cross_entropy", "linear_cross_entropy"): linear_cross_entropy,
                ("verl.utils.torch_functional", "logprobs_from_logits"): logprobs_from_logits,
                ("verl.utils.torch_functional", "entropy_from_logits"): entropy_from_logits}


def apply(*, backend: str = "auto", require_fused: bool = False, phases: bool = True) -> Patch:
    """Route verl's ``linear_cross_entropy``, ``logprobs_from_logits`` and ``entropy_from_logits`` through rlkernel
    (process-wide) as the module docstring says (``phases``: accepted, no range here). Returns the Patch
    (``undo()``, or a context manager); a second call with the same options returns the active one. Raises
    UnsupportedVersionError outside verl >=0.9,<0.10."""
    import verl

    check_version("verl", "verl", verl.__version__, MINIMUM, BELOW)
    options = {"backend": backend, "require_fused": bool(require_fused)}
    recorded = {**options, "phases": bool(phases)}  # options: the rlkernel ops' keywords
    existing = _slot.reuse(recorded)
    if existing is not None:
        return existing
    check_options(backend, require_fused)
    targets = [(importlib.import_module(mod_name), name, new) for (mod_name, name), new in REPLACEMENTS.items()]
    return _slot.install(targets + bound_by_name("verl.", targets), recorded, options)
