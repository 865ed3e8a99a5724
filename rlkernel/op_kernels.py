"""Which kernels other than the project's own may run inside an op's range on the fused path (docs/contracts.md,
section 3). Plain data, torch-free: the trace analysis (``pipelines.analysis``) reads it without importing torch.

An op range is fused when it ran at least one ``rlkernel_*`` kernel and every other kernel in it matches that op's
helper globs here. Ops missing from the table have no helpers: their fused range runs ``rlkernel_*`` kernels only.
The globs are per op on purpose: a GEMM in a training step or in another op's range never counts as fused work, and
a native ``linear_logp`` range (a GEMM and PyTorch's softmax kernels) has no ``rlkernel_*`` kernel, so it never reads
fused. Globs are matched (case-sensitively, as SQL GLOB) against the short and the demangled kernel name.
"""
from __future__ import annotations

# cuBLAS / cuBLASLt GEMM kernels as nsys names them on A100/H100/H200 builds: `nvjet_tst_...` (cuBLASLt's Hopper
# JIT kernels), `sm90_xmma_gemm_...`, `ampere_bf16_s16816gemm_...`, `cutlass::Kernel2<cutlass_80_...gemm...>`, the
# gemv kernels a one-row product gets, and cuBLASLt's split-K reduction that follows a split-K GEMM.
CUBLAS_GEMM = ("*gemm*", "*Gemm*", "*gemv*", "nvjet*", "*xmma*", "*cutlass*", "*splitKreduce*")

HELPER_GLOBS: dict[str, tuple[str, ...]] = {
    # hidden @ weight.T by cuBLAS into a bounded workspace, then the rlkernel_ online-softmax kernels
    "linear_logp.forward": CUBLAS_GEMM,
    # recomputed logits tiles, then dH = G @ W and dW = G^T @ H by cuBLAS
    "linear_logp.backward": CUBLAS_GEMM,
    # per token chunk: the logits GEMM, the fused logp kernels, dH and dW GEMMs (bias gradient: a gemv)
    "linear_logp_loss": CUBLAS_GEMM,
}


def helper_rows() -> list[tuple[str, str]]:
    """(op, glob) pairs, the form the verdict query reads (temp table ``op_helper_globs``)."""
    return [(op, pat) for op, pats in sorted(HELPER_GLOBS.items()) for pat in pats]
