"""rlkernel.integrations: one line per framework puts rlkernel's LM-head ops into its trainer.

- ``rlkernel.integrations.transformers.apply(model)``: a causal LM's ``forward(labels=...)`` computes its loss with
  ``rlkernel.linear_logp_loss`` (and, with ``per_token_logps=True``, per-token log-probs / entropy with
  ``rlkernel.linear_logp``), never holding the N x V logits.
- ``rlkernel.integrations.trl.apply()``: TRL's fused LM head (``GRPOTrainer`` and the other ``add_fused_lm_head``
  trainers) runs ``rlkernel.linear_logp``.
- ``rlkernel.integrations.openrlhf.apply()``: OpenRLHF's ``log_probs_from_logits`` / ``compute_entropy`` run
  ``rlkernel.logp``.
- ``rlkernel.integrations.verl.apply()``: verl's ``linear_cross_entropy`` (its ``use_fused_kernels`` head) runs
  ``rlkernel.linear_logp``, its ``logprobs_from_logits`` / ``entropy_from_logits`` ``rlkernel.logp``.

Each ``apply`` returns a ``Patch`` (``undo()``, or use it as a context manager), is idempotent, and raises
``UnsupportedVersionError`` for a framework version it does not support. What rlkernel cannot compute goes back to
the framework's own code with a dispatch record saying why (``rlkernel.dispatch.framework_fallback``,
docs/contracts.md section 2). The framework modules are imported only by their own integration.
``apply(phases=True)``, the default, also marks the standard RL phases where the framework runs them (TRL's
GRPOTrainer; none in verl and OpenRLHF, whose patched functions run in several phases: docs/contracts.md section 3).
"""
import importlib

from rlkernel.integrations._patch import Patch, UnsupportedVersionError

__all__ = ["Patch", "UnsupportedVersionError", "openrlhf", "transformers", "trl", "verl"]
_FRAMEWORKS = ("openrlhf", "transformers", "trl", "verl")


def __getattr__(name):  # rlkernel.integrations.trl.apply() after a plain `import rlkernel`
    if name not in _FRAMEWORKS:
        raise AttributeError(f"module 'rlkernel.integrations' has no attribute {name!r}")
    return importlib.import_module(f"rlkernel.integrations.{name}")
