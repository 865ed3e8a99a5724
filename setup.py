"""Build of the optional CUDA extension rlkernel._C in the tree (metadata lives in pyproject.toml).

The usual way to get the fused kernels is no build here at all: a plain install ships csrc/ inside the package, and
the first call that needs rlkernel._C builds it into a per-user cache, or `python -m rlkernel.build` does ahead of
time (rlkernel/_ext.py, rlkernel/_jit.py). An in-tree build still wins where it is there:
`MAX_JOBS=2 python setup.py build_ext --inplace` builds it from csrc/ (every csrc/*.cu and csrc/*.cpp: the kernels,
the op library and its op files, the Python module and the stream helper; with the flags of rlkernel/_jit.py) for
TORCH_CUDA_ARCH_LIST, or for the local GPU when that is unset. torch is imported only
here, only to build: without torch (pip's isolated build), with a CPU-only torch, without nvcc, or with
RLKERNEL_BUILD_EXT=0, `pip install .` still works and builds nothing here.
"""
from __future__ import annotations

import ast
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


def _jit_flags() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """rlkernel/_jit.py's CXX_FLAGS and NVCC_FLAGS, read from its text (literals: nothing of it runs here)."""
    with open(os.path.join(ROOT, "rlkernel", "_jit.py")) as f:
        tree = ast.parse(f.read())
    flags = {t.id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
             for t in node.targets if isinstance(t, ast.Name) and t.id in ("CXX_FLAGS", "NVCC_FLAGS")}
    return flags["CXX_FLAGS"], flags["NVCC_FLAGS"]


def _cutlass_include() -> list[str]:
    """The nvidia-cutlass wheel's header folder (rlkernel/cutlass_headers.py, loaded by path: nothing of rlkernel
    imported), [] without the wheel (the epilogue GEMM then builds as a stub that refuses)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_rlkernel_cutlass_headers",
                                                  os.path.join(ROOT, "rlkernel", "cutlass_headers.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    inc = mod.include_dir()
    return [inc] if inc else []


def _cuda_extension():
    if os.environ.get("RLKERNEL_BUILD_EXT", "").strip().lower() in ("0", "false", "no", "off"):
        return _skip("RLKERNEL_BUILD_EXT=0: the first call that needs it builds it into the cache")
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
    cxx_flags, nvcc_flags = _jit_flags()
    ext = cpp_extension.CUDAExtension(
        name="rlkernel._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc", "include"), *_cutlass_include()],
        define_macros=[("RLKERNEL_BUILT_ARCHS", f'"{archs}"')],
        extra_compile_args={"cxx": list(cxx_flags), "nvcc": list(nvcc_flags)},  # the cache's build uses the same
    )
    return [ext], {"build_ext": cpp_extension.BuildExtension}


ext_modules, cmdclass = _cuda_extension()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
