"""Fixture program: Liger's log-prob kernels, each family in its own rlkernel phase, for the "who computed the
log-probs" globs (rlkernel/op_kernels.py LOGPROB_FAMILIES; tests/test_analyze_phases.py reads the capture).

Each of --steps steps (rlkernel.step, index 0, 1, ...) runs, on one GPU, a Qwen2.5-0.5B-sized LM head (hidden
896, vocabulary 151936, bf16) over 4 x 64 completion tokens:
  liger_flce               LigerFusedLinearCrossEntropyLoss forward + backward (Triton liger_cross_entropy_kernel,
                           element_mul_kernel; cuBLAS GEMMs)
  liger_selective_logprob  liger_kernel.ops.grpo_loss.fused_selective_log_softmax on the logits (no grad)
  liger_grpo_loss          liger_kernel.transformers.grpo_loss.triton_grpo_loss forward + backward on the logits
                           (Triton _grpo_loss_fwd_kernel / _grpo_loss_bwd_kernel)
  liger_chunked_grpo       liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss(compiled=False) forward + backward:
                           its log-probs are plain PyTorch ops (matmul, amax, exp, sum, log), no Liger kernel
  torch_log_softmax        torch.log_softmax + gather on the logits (PyTorch's own, for contrast)
The logits of the last three come from one GEMM outside the phases.

    usage: python tools/traces/liger_job.py [--steps N]
           (under `python -m pipelines.capture -- ...`, by tools/make_capture_fixtures.sh OUTDIR liger)
Needs CUDA and liger-kernel (the node kit has 0.8.5): exit 3 without them.
"""
from __future__ import annotations

import os
import sys

ROWS, LENGTH, HIDDEN, VOCAB = 4, 64, 896, 151936


def first(out):
    """The loss of a Liger loss call: the tensor itself, or the first of (loss, metrics)."""
    return out[0] if isinstance(out, (tuple, list)) else out


def main(steps: int) -> int:
    import torch

    import rlkernel

    if not torch.cuda.is_available():
        print("liger_job: needs a CUDA device", file=sys.stderr)
        return 3
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
        from liger_kernel.ops.grpo_loss import fused_selective_log_softmax
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss
    except ImportError as e:
        print(f"liger_job: {e} (pip install liger-kernel)", file=sys.stderr)
        return 3
    from importlib.metadata import version

    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    weight = (torch.randn(VOCAB, HIDDEN, device=dev) * 0.02).to(dt).requires_grad_(True)
    hidden = torch.randn(ROWS, LENGTH, HIDDEN, device=dev, dtype=dt)
    ids = torch.randint(0, VOCAB, (ROWS, LENGTH), device=dev)
    mask = torch.ones(ROWS, LENGTH, device=dev)
    advantages = torch.randn(ROWS, device=dev)
    flce = LigerFusedLinearCrossEntropyLoss()
    chunked = LigerFusedLinearGRPOLoss(beta=0.0, compiled=False, use_ref_model=False)
    # backward on this thread, so its kernels are launched inside the phase ranges (as nsys and the analyzer
    # attribute them), not from autograd's device thread
    torch.autograd.set_multithreading_enabled(False)
    for _ in range(steps):
        with rlkernel.step():
            with rlkernel.phase("liger_flce"):
                h = hidden.reshape(-1, HIDDEN).detach().requires_grad_(True)
                first(flce(weight, h, ids.reshape(-1))).backward()
            with torch.no_grad():
                logits = torch.nn.functional.pad((hidden @ weight.detach().T).float(), (0, 0, 0, 1))  # (B, L+1, V)
            with rlkernel.phase("liger_selective_logprob"):
                old = fused_selective_log_softmax(logits, ids, temperature=1.0)
            with rlkernel.phase("liger_grpo_loss"):
                lg = logits.detach().clone().requires_grad_(True)
                first(triton_grpo_loss(lg, old, None, ids, advantages, mask, temperature=1.0, beta=0.0,
                                       reduce=True)).backward()
            with rlkernel.phase("liger_chunked_grpo"):
                h = hidden.detach().requires_grad_(True)
                first(chunked(h, weight, ids, mask, advantages, old_per_token_logps=old)).backward()
            with rlkernel.phase("torch_log_softmax"), torch.no_grad():
                ref = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
            weight.grad = None
    torch.cuda.synchronize()
    print(f"liger_job: {steps} steps on {torch.cuda.get_device_name()} (liger-kernel "
          f"{version('liger-kernel')}), max |liger - torch| log-prob "
          f"{(old - ref).abs().max().item():.3g}", flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):  # help only: nothing imported, run or written
        sys.exit(print(__doc__.strip()))
    args = sys.argv[1:]
    n = int(args[args.index("--steps") + 1]) if "--steps" in args else 2
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # this tree's rlkernel
    sys.exit(main(n))
