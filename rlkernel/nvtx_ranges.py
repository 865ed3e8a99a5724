"""NVTX ranges in domain ``rlkernel`` (docs/contracts.md, section 3).

Messages are registered strings (the ``nvtx`` package caches them). With no profiler attached an
NVTX push/pop is a call into a no-op stub. While ``torch.compile`` traces, no range is opened, so the
graph does not break; the fused ops open theirs in C++ instead.
"""
from __future__ import annotations

import contextlib

import torch

DOMAIN = "rlkernel"

try:
    import nvtx as _nvtx
except ImportError:  # nvtx is a run-time dependency; without it ranges are absent, never an error
    _nvtx = None


def _compiling() -> bool:
    return torch.compiler.is_compiling()


@contextlib.contextmanager
def _range(message: str):
    if _nvtx is None or _compiling():
        yield
        return
    with _nvtx.annotate(message, domain=DOMAIN):
        yield


def op_range(name: str):
    """Range around the native work of one op call: ``op.logp.forward``, ``op.logp.backward``, ``op.sample``."""
    return _range(name)


def workload_range(name: str):
    """Range around one workload repetition; message = the workload's registry name."""
    return _range(name)
