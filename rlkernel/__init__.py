"""rlkernel: fast, honest GPU kernels for RL post-training (per-token log-probs and sampling).

Every op call leaves a dispatch record saying which path ran (see ``rlkernel.dispatch`` and
``docs/contracts.md``). The ops are imported on first use, so torch-free modules such as ``rlkernel.cli``
(exit codes) can be imported without importing torch; so are the training phases (``rlkernel.phase``,
``rlkernel.step``: NVTX ranges, contract 3), which import no torch at all.
"""
import importlib

__version__ = "0.1.0"
__all__ = ["logp", "linear_logp", "linear_logits", "sample", "check_errors", "dispatch", "FusedKernelUnavailable",
           "FallbackWarning", "linear_logp_loss", "phase", "step", "step_begin", "step_end", "fused_status",
           "integrations", "__version__"]

_LAZY = {"logp": ("rlkernel.ops.logp", "logp"), "linear_logp": ("rlkernel.ops.linear_logp", "linear_logp"),
         "linear_logits": ("rlkernel.ops.linear_logits", "linear_logits"),
         "linear_logp_loss": ("rlkernel.ops.linear_logp_loss", "linear_logp_loss"),
         "sample": ("rlkernel.ops.sampling", "sample"),
         "check_errors": ("rlkernel.errors", "check_errors"), "dispatch": ("rlkernel.dispatch", None),
         "integrations": ("rlkernel.integrations", None),
         "FusedKernelUnavailable": ("rlkernel.dispatch", "FusedKernelUnavailable"),
         # torch-free: a process marks its phases without importing torch (rlkernel.phases)
         "phase": ("rlkernel.phases", "phase"), "step": ("rlkernel.phases", "step"),
         "step_begin": ("rlkernel.phases", "step_begin"), "step_end": ("rlkernel.phases", "step_end"),
         # whether the fused path is available, where rlkernel._C came from, why not (builds nothing)
         "fused_status": ("rlkernel._ext", "fused_status")}


class FallbackWarning(UserWarning):
    """backend="auto" wanted the fused path and ran native instead (said once per op and reason): expected on a
    CPU or without the built extension. Defined here, not in torch-importing ``rlkernel.dispatch`` (which
    re-exports it), so that naming it (``warnings.filterwarnings("ignore", category=rlkernel.FallbackWarning)``)
    imports no torch. (``python -W`` cannot name it in an installed package: Python reads ``-W`` before
    site-packages are importable.)"""


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'rlkernel' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = importlib.import_module(module)
    value = getattr(value, attr) if attr else value
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
