"""rlkernel: fast, honest GPU kernels for RL post-training (per-token log-probs and sampling).

Every op call leaves a dispatch record saying which path ran (see ``rlkernel.dispatch`` and
``docs/contracts.md``).
"""
from rlkernel import dispatch
from rlkernel.dispatch import FallbackWarning, FusedKernelUnavailable
from rlkernel.ops.logp import logp
from rlkernel.ops.sampling import sample

__version__ = "0.1.0"
__all__ = ["logp", "sample", "dispatch", "FusedKernelUnavailable", "FallbackWarning", "__version__"]
