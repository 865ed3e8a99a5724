"""cuBLAS settings for batch-invariant GEMMs, shared by both linear_logp backends (fused/linear_logp runs its tiles
under them, native/linear_logp its padded chunks), and the float32-output GEMM of 16-bit operands behind
``logits_dtype=torch.float32`` (its probe, its call, and the dispatch decision it adds): in neither backend, so the
native reference needs nothing of the fused one."""
from __future__ import annotations

import contextlib

import torch

from rlkernel import dispatch

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


SIXTEEN_BIT = (torch.bfloat16, torch.float16)
_f32_out: dict[tuple, tuple[str | None, str]] = {}  # (device index, dtype, batch_invariant) -> float32_output_gemm


def float32_output_gemm(device: torch.device, dtype: torch.dtype, batch_invariant: bool = False) -> tuple:
    """(reason or None, bias mode): whether aten's CUDA GEMM of ``dtype`` (bf16/fp16) operands writes a float32
    result from its float32 accumulator (``mm.dtype_out``, cuBLAS / cuBLASLt with a float32 C/D type) on this torch,
    under ``batch_invariant_blas`` when asked. Bias mode "addmm": ``addmm.dtype_out`` takes the 16-bit ``[cols]``
    bias (added in float32 by the GEMM); "add": the bias is added to the float32 result by torch's add kernel after
    the GEMM (torch versions whose ``addmm.dtype_out`` wants a bias of the operands' dtype refuse a vector).
    Probed once per key on 2 x 2 tensors: no values read, nothing but the GEMMs launched."""
    key = (device.index, dtype, bool(batch_invariant))
    found = _f32_out.get(key)
    if found is None:
        a = torch.empty(2, 2, dtype=dtype, device=device)
        out = torch.empty(2, 2, dtype=torch.float32, device=device)
        refused = (RuntimeError, TypeError, NotImplementedError, AttributeError)  # AttributeError: no such overload
        with batch_invariant_blas(dtype, device, batch_invariant):
            try:
                torch.ops.aten.mm.dtype_out(a, a, torch.float32, out=out)
            except refused as e:
                found = (f"no float32-output GEMM of {str(dtype).removeprefix('torch.')} operands in this torch "
                         f"({type(e).__name__})", "")
            if found is None:
                try:
                    torch.ops.aten.addmm.dtype_out(a[0], a, a, torch.float32, out=out)
                    found = (None, "addmm")
                except refused:
                    found = (None, "add")
        _f32_out[key] = found
    return found


def float32_logits(h: torch.Tensor, w_t: torch.Tensor, bias, out: torch.Tensor, bias_mode: str) -> torch.Tensor:
    """out (float32) = h @ w_t (+ bias): 16-bit operands, float32 accumulation and output, never rounded to 16 bits
    (``bias_mode`` from ``float32_output_gemm``)."""
    if bias is not None and bias_mode == "addmm":
        return torch.ops.aten.addmm.dtype_out(bias, h, w_t, torch.float32, out=out)
    torch.ops.aten.mm.dtype_out(h, w_t, torch.float32, out=out)
    return out if bias is None else out.add_(bias)


def float32_fallback(op: str, backend: str, require_fused: bool, device: torch.device, dtype: torch.dtype,
                     batch_invariant: bool = False):
    """The dispatch record of a float32-logits call of 16-bit inputs whose fused path would lack the float32-output
    GEMM (this torch refuses it): recorded ``fallback`` to native with that reason (``blocked`` and
    ``FusedKernelUnavailable`` where the fused path is demanded), as for any missing piece; None when nothing is
    missing (the caller then takes ``dispatch.resolve`` as usual)."""
    wants_fused = backend in ("auto", "fused") and device.type == "cuda" and not torch.compiler.is_compiling()
    if not (dtype in SIXTEEN_BIT and wants_fused and dispatch.fused_unavailable_reason(op, device, dtype) is None):
        return None
    reason, _ = float32_output_gemm(device, dtype, batch_invariant)
    if reason is None:
        return None
    if backend == "fused" or require_fused or dispatch.strict_from_env():
        dispatch.record(op, backend, "none", "blocked", reason)
        raise dispatch.FusedKernelUnavailable(f"{op}: fused path required but unavailable: {reason}")
    return dispatch.record(op, backend, "native", "fallback", reason)
