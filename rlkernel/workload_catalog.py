"""The workload registry as plain data, torch-free: what a reader of traces and the CLIs' ``--help`` need (names in
registration order, op, path, fused_ops, fused_patterns) without importing torch.

``rlkernel.workloads`` defines the workloads and imports torch; this module repeats the fields that name them.
tests/test_workload_catalog.py checks that the two agree for every workload, so a workload added there and not
here fails a test rather than going unnoticed. It lives outside ``rlkernel/workloads/`` because importing any
module of that package runs its ``__init__``, which imports torch.
"""
from __future__ import annotations

DTYPE_NAMES = ("float32", "float16", "bfloat16")  # rlkernel.numerics.DTYPES's keys
DEFAULT_FUSED_PATTERNS = ("rlkernel_*",)

# (name, op, path, fused_ops), in rlkernel.workloads.names() order; every workload's fused_patterns is the default
_ENTRIES = (
    ("logp-native", "logp", "native", ()),
    ("logp-native-bwd", "logp+backward", "native", ()),
    ("sampling-native", "sample", "native", ()),
    ("sampling-mixed-native", "sample", "native", ()),
    ("logp-fused", "logp", "fused", ("logp.forward",)),
    ("logp-fused-bwd", "logp+backward", "fused", ("logp.forward", "logp.backward")),
    ("sampling-fused", "sample", "fused", ("sample",)),
    ("sampling-mixed-fused", "sample", "fused", ("sample",)),
    ("linear-logp-native", "linear_logp", "native", ()),
    ("linear-logp-fused", "linear_logp", "fused", ("linear_logp.forward",)),
    ("linear-logp-fused-bwd", "linear_logp+backward", "fused", ("linear_logp.forward", "linear_logp.backward")),
    ("grpo-step", "grpo-step", "fused", ("sample", "logp.forward", "logp.backward")),
)

CATALOG: dict[str, dict] = {
    name: {"op": op, "path": path, "fused_ops": list(fused_ops), "fused_patterns": list(DEFAULT_FUSED_PATTERNS)}
    for name, op, path, fused_ops in _ENTRIES
}


def names() -> list[str]:
    """The registry's workload names in registration order (``rlkernel.workloads.names()``), torch-free."""
    return list(CATALOG)
