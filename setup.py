"""Build of the optional CUDA extension rlkernel._C (metadata lives in pyproject.toml).

`MAX_JOBS=2 python setup.py build_ext --inplace` builds it from csrc/ (every csrc/*.cu and csrc/*.cpp: the kernels,
the op library and its op files, the Python module and the stream helper) for TORCH_CUDA_ARCH_LIST, or for the
local GPU when that is unset. torch is imported only here, only to build: without torch, with a CPU-only torch, or without nvcc, `pip install -e .` still works and builds nothing
(rlkernel then runs its native path and says why: "extension not built").
"""
from __future__ import annotations

import glob
import os
import re
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _skip(reason: str):
    print(f"rlkernel setup.py: not building the CUDA extension ({reason})", file=sys.stderr)
    return [], {}


def _built_archs(arch_flags: list[str]) -> list[str]:
    """The sm_XX targets the -gencode flags produce machine code for (recorded as rlkernel._C.BUILT_ARCHS)."""
    archs = []
    for flag in arch_flags:
        for code in re.findall(r"code=\[?([\w,]+)\]?", flag):
            archs += [c for c in code.split(",") if c.startswith("sm_") and c not in archs]
    return archs


def _cuda_extension():
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        return _skip("torch is not importable")
    if torch.version.cuda is None:
        return _skip(f"torch {torch.__version__} has no CUDA")
    if cpp_extension.CUDA_HOME is None:
        return _skip("nvcc / CUDA_HOME not found")
    arch_flags = cpp_extension._get_cuda_arch_flags()  # honours TORCH_CUDA_ARCH_LIST, else the visible GPUs
    archs = ",".join(_built_archs(arch_flags))
    rel = lambda p: os.path.relpath(p, ROOT)  # setuptools wants sources relative to setup.py
    sources = [rel(p) for p in sorted(glob.glob(os.path.join(ROOT, "csrc", "*.cu")))]
    sources += [rel(p) for p in sorted(glob.glob(os.path.join(ROOT, "csrc", "*.cpp")))]  # library, ops, module, stream
    ext = cpp_extension.CUDAExtension(
        name="rlkernel._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc", "include")],
        define_macros=[("RLKERNEL_BUILT_ARCHS", f'"{archs}"')],
        extra_compile_args={
            "cxx": ["-O3"],
            # -lineinfo: ncu maps its counters to source lines; it does not change the generated code.
            "nvcc": ["-O3", "-lineinfo", "-Xptxas=-warn-spills"],
        },
    )
    return [ext], {"build_ext": cpp_extension.BuildExtension}


ext_modules, cmdclass = _cuda_extension()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
