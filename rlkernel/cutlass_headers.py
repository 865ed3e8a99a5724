"""Where the CUTLASS / CuTe headers of the epilogue GEMM (csrc/linear_logp_epilogue.cu) come from: the pinned
``nvidia-cutlass`` wheel (``pip install 'rlkernel[cuda]'``), whose ``cutlass_library/source/include`` holds ``cute/``
and ``cutlass/``. Standard library only: setup.py loads this file by path and tools/compile_gate.sh runs it
(``python rlkernel/cutlass_headers.py`` prints the folder, or nothing), so neither imports rlkernel or torch.
Without the wheel the extension still builds; the epilogue GEMM then only refuses, and linear_logp keeps its
cuBLAS path.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os

PIN = "nvidia-cutlass==4.2.0.0"  # the version pyproject.toml's cuda extra and tox's csrc env pin


def include_dir() -> str | None:
    """The wheel's include folder (holding cute/tensor.hpp), or None where the wheel is not installed."""
    spec = importlib.util.find_spec("cutlass_library")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        return None
    for base in spec.submodule_search_locations:
        inc = os.path.join(base, "source", "include")
        if os.path.isfile(os.path.join(inc, "cute", "tensor.hpp")):
            return inc
    return None


def version() -> str | None:
    """The installed wheel's version (part of the build's key: other headers, another build)."""
    try:
        return importlib.metadata.version("nvidia-cutlass")
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    print(include_dir() or "")
