"""rlkernel.integrations.openrlhf: OpenRLHF's per-token log-probs and entropy through rlkernel.logp.

OpenRLHF's ``Actor.forward`` scores the float32 logits it holds with ``openrlhf.models.utils.log_probs_from_logits``
and ``compute_entropy``. ``apply()`` replaces both module globals, and the same names in every ``openrlhf`` module
already imported that bound them (``from .utils import ...``: ``openrlhf.models.actor``); a module imported later
binds the replacements (after ``undo()`` they call OpenRLHF's own again). They keep OpenRLHF's semantics:
``log_probs_from_logits(logits, labels, temperature)`` divides the logits in place by a temperature other than 1
(as OpenRLHF's does; not where rlkernel.logp will refuse the call: then the logits are unchanged), both return
``logits.shape[:-1]`` in the logits' dtype, computed in float32 by rlkernel.logp (OpenRLHF's bfloat16 path
computes in bfloat16), and ``compute_entropy`` scores a dummy id (id 0) for the entropy, which rlkernel.logp
returns with a log-prob.
Nothing falls back: every call OpenRLHF makes is one rlkernel.logp computes (its own records say which path ran).

Tested against the functions themselves: importing ``openrlhf.models`` imports ``Actor``, whose module imports
``flash_attn``, which cannot be built on a CPU machine, so ``Actor.forward`` itself is untested here.

Phases (contract 3): none. Both functions run in more than one standard phase (``Actor.forward`` scores the old
log-probs, the reference model's and the training forward alike), so no phase range fits them;
``apply(phases=True)``, the default of every integration, adds none here. Mark OpenRLHF's phases around its calls
with ``rlkernel.phase``.
"""
from __future__ import annotations

import importlib
from importlib import metadata

import torch

import rlkernel
from rlkernel import dispatch
from rlkernel.integrations._patch import Patch, ProcessPatch, bound_by_name, check_options, check_version
from rlkernel.validate import check_logp_args

OP = "integrations.openrlhf"
MINIMUM, BELOW = (0, 11), (0, 12)
NAMES = ("log_probs_from_logits", "compute_entropy")
_slot = ProcessPatch("rlkernel.integrations.openrlhf")


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """OpenRLHF's ``log_probs_from_logits`` by rlkernel.logp, OpenRLHF's in-place division of the logits by a
    temperature other than 1 kept (its ``compute_entropy`` then reads the divided logits; the division is part of
    the autograd graph, as OpenRLHF's). A call rlkernel.logp refuses before any work (bad labels, a fused path
    demanded where it cannot run) is refused before the division too: the logits are left as they were."""
    if not _slot.active:
        return _slot.originals["log_probs_from_logits"](logits, labels, temperature)
    opts = _slot.options
    if temperature != 1.0:
        check_logp_args(logits, labels, 1.0, -100)
        if not dispatch.would_block("logp.forward", opts["backend"], opts["require_fused"], logits.device,
                                    logits.dtype):
            logits.div_(temperature)
    return rlkernel.logp(logits, labels, **opts).to(logits.dtype)


def compute_entropy(logits: torch.Tensor) -> torch.Tensor:
    """OpenRLHF's ``compute_entropy`` by rlkernel.logp's entropy (a dummy id 0 scored alongside)."""
    if not _slot.active:
        return _slot.originals["compute_entropy"](logits)
    ids = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    _, entropy = rlkernel.logp(logits, ids, return_entropy=True, **_slot.options)
    return entropy.to(logits.dtype)


REPLACEMENTS = {"log_probs_from_logits": log_probs_from_logits, "compute_entropy": compute_entropy}


def apply(*, backend: str = "auto", require_fused: bool = False, phases: bool = True) -> Patch:
    """Route OpenRLHF's ``log_probs_from_logits`` and ``compute_entropy`` through ``rlkernel.logp`` (process-wide;
    ``phases``: accepted, no range here). Returns the Patch (``undo()``, or a context manager); a second call with
    the same options returns the active one. Raises UnsupportedVersionError outside openrlhf >=0.11,<0.12."""
    import openrlhf  # noqa: F401  (ImportError where it is not installed)

    check_version("openrlhf", "openrlhf", metadata.version("openrlhf"), MINIMUM, BELOW)
    utils = importlib.import_module("openrlhf.models.utils")
    options = {"backend": backend, "require_fused": bool(require_fused)}
    recorded = {**options, "phases": bool(phases)}  # options: the rlkernel ops' keywords
    existing = _slot.reuse(recorded)
    if existing is not None:
        return existing
    check_options(backend, require_fused)
    targets = [(utils, name, REPLACEMENTS[name]) for name in NAMES]
    return _slot.install(targets + bound_by_name("openrlhf.", targets), recorded, options)
