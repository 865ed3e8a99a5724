"""The one cached loader of the CUDA extension ``rlkernel._C`` (built by ``python setup.py build_ext --inplace``)."""
from __future__ import annotations

import importlib


class ExtensionNotBuilt(ImportError):
    """rlkernel._C is missing or failed to load; ``reason`` says which."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


_loaded: tuple | None = None  # (module or None, reason or None), set once: plain data that torch.compile can read
_ops: dict[str, bool] = {}


def _try_load():
    global _loaded
    if _loaded is None:
        _loaded = _load_once()
    return _loaded


def _load_once():
    try:
        module = importlib.import_module("rlkernel._C")  # importing registers torch.ops.rlkernel.*
    except ImportError as exc:
        if getattr(exc, "name", None) == "rlkernel._C":
            return None, "extension not built"
        return None, f"extension failed to load: {exc}"
    except OSError as exc:  # e.g. a CUDA library missing at load time
        return None, f"extension failed to load: {exc}"
    return module, None


def load():
    """Return the loaded extension module, or raise ExtensionNotBuilt."""
    module, reason = _try_load()
    if module is None:
        raise ExtensionNotBuilt(reason)
    return module


def unavailable_reason() -> str | None:
    return _try_load()[1]


def has_op(name: str) -> bool:
    """Whether the loaded extension registered ``torch.ops.rlkernel.<name>*`` (e.g. ``logp``, ``sample``); what a
    loaded library registered never changes, so the answer is kept."""
    known = _ops.get(name)
    if known is None:
        known = _ops[name] = _has_op(name)
    return known


def _has_op(name: str) -> bool:
    if _try_load()[0] is None:
        return False
    import torch

    ns = torch.ops.rlkernel
    prefixes = {"logp": "logp_forward", "sample": "sample", "linear_logp": "linear_logp_fold",
                "linear_logp_loss": "logp_forward"}  # the loss runs the logp kernels between cuBLAS GEMMs
    try:
        getattr(ns, prefixes.get(name, name))
    except (AttributeError, RuntimeError):
        return False
    return True


def built_archs() -> list[str]:
    """The GPU architectures the extension carries code for (recorded by setup.py), [] when not built."""
    module = _try_load()[0]
    return list(getattr(module, "BUILT_ARCHS", [])) if module is not None else []
