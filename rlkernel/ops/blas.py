"""cuBLAS settings for batch-invariant GEMMs, shared by both linear_logp backends (fused/linear_logp runs its tiles
under them, native/linear_logp its padded chunks): in neither backend, so the native reference needs nothing of the
fused one."""
from __future__ import annotations

import contextlib

import torch

_SPLIT_K_FLAGS = {torch.bfloat16: "allow_bf16_reduced_precision_reduction",
                  torch.float16: "allow_fp16_reduced_precision_reduction"}


@contextlib.contextmanager
def batch_invariant_blas(dtype: torch.dtype, device: torch.device, on: bool = True):
    """With batch_invariant on CUDA: cuBLAS GEMMs through cuBLASLt without split-K / stream-K reductions, whose split
    of K could differ between the output tiles a row may fall in (torch's preferred BLAS backend "cublaslt" and, for
    16-bit GEMMs, (allow_reduced_precision, allow_splitk) = (False, False), which torch accepts only with cuBLASLt).
    Both restored after the call; a setting this torch lacks is left as it is. Process-wide while it lasts."""
    if not on or device.type != "cuda":
        yield
        return
    matmul = torch.backends.cuda.matmul
    backend = flag = None
    try:
        backend = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
    except (TypeError, ValueError, RuntimeError, AttributeError):
        backend = None
    attr = _SPLIT_K_FLAGS.get(dtype) if backend is not None else None
    if attr is not None:
        try:
            flag = (getattr(matmul, attr), getattr(matmul, attr + "_split_k", True))
            setattr(matmul, attr, (False, False))
        except (TypeError, ValueError, RuntimeError, AttributeError):
            flag = None
    try:
        yield
    finally:
        if flag is not None:
            setattr(matmul, attr, flag)
        if backend is not None:
            torch.backends.cuda.preferred_blas_library(backend)
