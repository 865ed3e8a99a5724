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


# Who computed the log-probs (the RL-step report's phases.csv, column logprob_by): kernel-name globs of each
# family, first match wins, in this order. The rlkernel families also count every kernel inside an
# `op.logp.*` / `op.linear_logp*` range (the native path runs PyTorch's kernels there, by verdict); the others are
# recognised by name only. Globs are matched as SQL GLOB against the short and the demangled name. TRL's chunked
# log-prob kernels are the Triton functions `_forward_kernel` / `_backward_kernel` of trl/kernels/chunked_logprob.py
# and logprob_entropy.py (TRL 1.16; nsys names a Triton kernel by its function: seen in tests/data/capture_trl);
# Liger's (liger-kernel 0.8.5) are its Triton kernels: `liger_cross_entropy_kernel` and `element_mul_kernel` of
# LigerFusedLinearCrossEntropyLoss, `_selective_log_softmax_kernel` and `_grpo_loss_{fwd,bwd}_kernel[_seq]` of
# triton_grpo_loss / fused_selective_log_softmax (first here: `*log_softmax*` below would take the selective one);
# its chunked LigerFusedLinearGRPOLoss computes log-probs with plain PyTorch ops (matmul, amax, exp, log) that no
# glob can tell apart (tools/traces/liger_job.py captures all of them: tests/data/capture_liger); PyTorch's
# log_softmax is `cunn_SoftMaxForward<..., LogSoftMaxForwardEpilogue>` or
# `softmax_warp_forward<..., (bool)1, ...>` (is_log_softmax set; `(bool)0` is a plain softmax, attention's).
LOGPROB_FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("rlkernel fused", ("rlkernel_logp_*", "rlkernel_linear_logp_*")),
    ("Liger", ("*liger*", "_cross_entropy_kernel*", "*element_mul_kernel*", "_selective_log_softmax_kernel*",
               "_grpo_loss_fwd_kernel*", "_grpo_loss_bwd_kernel*", "_jsd_kernel*")),
    ("TRL chunked", ("_forward_kernel", "_backward_kernel", "triton_*log_softmax*gather*")),
    ("PyTorch log_softmax", ("*LogSoftMax*", "*log_softmax*", "*logsoftmax*",
                             "*softmax_warp_forward<*(bool)1, (bool)*", "*softmax_warp_backward<*(bool)1, (bool)*")),
    ("PyTorch cross-entropy", ("*nll_loss*", "*cross_entropy*")),
)
# Op ranges whose kernels are rlkernel's log-prob work on either path (contract 3): their verdict names the path.
LOGPROB_OP_RANGES = ("rlkernel:op.logp.*", "rlkernel:op.linear_logp*")


def logprob_rows() -> list[tuple[int, str, str]]:
    """(rank, family, glob) rows, the form queries/phase_logprobs.sql reads (temp table ``logprob_globs``)."""
    return [(rank, fam, pat) for rank, (fam, pats) in enumerate(LOGPROB_FAMILIES) for pat in pats]
