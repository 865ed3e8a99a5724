"""ctypes bindings to tricky_lib.cu, built on first use with nvcc (the GPU node has nvcc 13.0).

The build goes to $TRICKY_BUILD_DIR (default: a per-user temp dir), never into the source tree:
a compiled library is a build output, not a fixture.
"""
from __future__ import annotations

import ctypes
import os
import pathlib
import subprocess
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
SRC = HERE / "tricky_lib.cu"


def _build() -> pathlib.Path:
    out_dir = pathlib.Path(os.environ.get("TRICKY_BUILD_DIR", tempfile.gettempdir())) / "rlkernel-traces"
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / "libtricky.so"
    if not lib.exists() or lib.stat().st_mtime < SRC.stat().st_mtime:
        arch = os.environ.get("TRICKY_ARCH", "sm_90a")
        cmd = ["nvcc", "-O2", f"-arch={arch}", "-shared", "-Xcompiler", "-fPIC", "-o", str(lib), str(SRC), "-ldl"]
        print("building", lib.name, ":", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    return lib


def load() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(_build()))
    i64, u64, vp, cp = ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_char_p
    sig = {
        "tl_domain": (i64, [cp]),
        "tl_register": (i64, [i64, cp]),
        "tl_push_inline": (None, [i64, cp]),
        "tl_push_registered": (None, [i64, i64]),
        "tl_pop": (None, [i64]),
        "tl_start": (u64, [i64, cp]),
        "tl_end": (None, [i64, u64]),
        "tl_fused": (ctypes.c_int, [vp, ctypes.c_int, vp]),
        "tl_spin": (ctypes.c_int, [ctypes.c_longlong, vp]),
        "tl_memset": (ctypes.c_int, [vp, ctypes.c_int, ctypes.c_size_t, vp]),
        "tl_memset_sync": (ctypes.c_int, [vp, ctypes.c_int, ctypes.c_size_t]),
        "tl_memcpy_sync": (ctypes.c_int, [vp, vp, ctypes.c_size_t, ctypes.c_int]),
        "tl_cub_scan": (ctypes.c_int, [vp, vp, ctypes.c_int, vp]),
        "tl_many": (ctypes.c_int, [ctypes.c_longlong, i64, i64]),
    }
    for name, (res, args) in sig.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed with CUDA error {rc}")
