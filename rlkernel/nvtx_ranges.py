"""NVTX ranges in domain ``rlkernel`` (docs/contracts.md, section 3).

The event attributes of each message are built once and cached, so a range is one push and one pop. With no
profiler attached the ``nvtx`` package hands out a dummy domain whose push/pop do nothing
(``benchmarks/bench_nvtx_overhead.py`` measures it). While ``torch.compile`` traces, no range is opened, so the
graph does not break; the fused ops open theirs in C++ instead.
"""
from __future__ import annotations

import torch

DOMAIN = "rlkernel"

try:
    import nvtx as _nvtx
except ImportError:  # nvtx is a run-time dependency; without it ranges are absent, never an error
    _nvtx = None

_domain = _nvtx.get_domain(DOMAIN) if _nvtx is not None else None
_attributes: dict[str, object] = {}


class _Range:
    __slots__ = ("_attrs", "_open")

    def __init__(self, message: str):
        attrs = None
        if not torch.compiler.is_compiling():  # no range in traced code (and no nvtx call dynamo cannot trace)
            attrs = _attributes.get(message)
            if attrs is None and _domain is not None:
                attrs = _attributes[message] = _domain.get_event_attributes(message=message)
        self._attrs = attrs
        self._open = False

    def __enter__(self):
        if self._attrs is not None:
            _domain.push_range(self._attrs)
            self._open = True
        return self

    def __exit__(self, *exc):
        if self._open:
            _domain.pop_range()
            self._open = False
        return False


def op_range(name: str) -> _Range:
    """Range around the native work of one op call: ``op.logp.forward``, ``op.logp.backward``, ``op.sample``."""
    return _Range(name)


def workload_range(name: str) -> _Range:
    """Range around one workload repetition; message = the workload's registry name."""
    return _Range(name)
