"""The workload registry: the one place a workload is defined (docs/contracts.md, section 4).

The profile suite, ``pipelines.capture`` and the GRPO example all run workloads from here, so a CSV row
and a trace of the same workload measure the same thing.

``registry`` holds the types and the table, ``common`` the helpers the families share, and each family its own
module (``logp``, ``sampling``, ``linear_logp``, ``grpo_step``). A new family is one more module and one more
entry in ``_FAMILIES``.
"""
from __future__ import annotations

from rlkernel.numerics import DTYPES
from rlkernel.workloads import grpo_step, linear_logp, logp, sampling
from rlkernel.workloads.registry import REGISTRY, Shape, Workload, fused_available, get, names, register

__all__ = ["DTYPES", "REGISTRY", "Shape", "Workload", "fused_available", "get", "names", "register"]

_PATHS = (("native", "native"), ("fused", "auto"))  # (path, the backend its workloads call the ops with)

# The registration order is public: names() lists it, the profile suite and capture run in it. Within a group the
# families take turns path by path (logp-native, logp-native-bwd, sampling-native, sampling-mixed-native,
# logp-fused, ...); the groups follow one another.
_FAMILIES = ((logp, sampling), (linear_logp,), (grpo_step,))

for _group in _FAMILIES:
    for _path, _backend in _PATHS:
        for _family in _group:
            for _workload in _family.workloads(_path, _backend):
                register(_workload)
