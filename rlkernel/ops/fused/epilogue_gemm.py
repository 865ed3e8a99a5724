"""The epilogue GEMM forward of ``linear_logp`` (issue 37): one Hopper GEMM whose epilogue folds the float32
accumulator into per-(row, 256-column tile) softmax partials, and a merge kernel; no logits tile at all
(``rlkernel_linear_logp_epilogue_gemm_kernel``, ``rlkernel_linear_logp_epilogue_merge_kernel``:
csrc/linear_logp_epilogue.cu).

- Its logits are float32 (the accumulator, plus the bias in float32) whatever ``logits_dtype`` says: with the inputs'
  dtype requested they are simply not rounded to 16 bits. The backward that follows it is the float32-logits one
  (``logits32``), so the gradient's softmax is that of the forward's logits.
- ``ENABLED``: ``"auto"`` (the default), the measured policy, False (off) or True (every call it covers); "auto"
  (docs/benchmarks.md, H200) takes, at hidden size <= ``AUTO_MAX_HIDDEN``, a call that asked for float32 logits, unless
  taking it adds a recompute to the backward; the gradient epilogue at that hidden size too. ``reason`` says why a
  call does not take it (recorded in ``records()``), and the caller then runs the cuBLAS tile + fold path.
- Rows go in blocks so the partials (16 bytes per row and tile) stay within ``PARTIAL_BYTES``.
- The backward of a float32-logits forward (the epilogue GEMM's, or ``logits_dtype=torch.float32``'s) takes the
  gradient epilogue where ``grad_reason`` allows (``GRAD``): per vocabulary chunk (``linear_logp``) or token chunk
  over the whole vocabulary (``linear_logp_loss``) one GEMM whose epilogue writes the 16-bit gradient of the logits
  (``rlkernel_linear_logp_grad_epilogue_gemm_kernel``), the dW / dH GEMMs' operand, in place of a float32 logits
  tile and the kernels that read it. Recorded in ``grad_records()``.
"""
from __future__ import annotations

import collections
import threading

import torch

from rlkernel import _ext

# False, True or "auto". "auto" takes what the H200 rows measured as a win (16384 x 896 x 151936: a float32-logits
# forward at 0.560x the cuBLAS path's; the gradient epilogue's backward faster than the float32 tile's) and leaves
# what they measured as a loss (any call at H = 4096: forward 1.062x; linear_logp_loss's epilogue forward followed
# by a float32-tile recompute: 6.62x the matmul). A 16-bit-logits call keeps the cuBLAS path, although its forward
# alone measured 0.854x: the epilogue's logits are float32, so the same call would give other log-probs without a
# backward (old / reference log-probs, epilogue) than with one (cuBLAS), and an importance ratio of the two would
# not be 1 on policy. A float32-logits linear_logp takes the epilogue with or without a backward (its backward
# recomputes either way), so its values do not depend on autograd. The default since the whole suite passed on the
# H200 with it (2026-12-05).
ENABLED: bool | str = "auto"
AUTO_MAX_HIDDEN = 1024  # "auto": measured a win at H = 896, a loss at 4096; between them unmeasured
# batch_invariant=True is covered: one tile shape, no split-K or stream-K (the persistent data-parallel scheduler),
# each output element's K sum in the same order, and each row's partials merged in a fixed order: a row's results
# depend neither on N nor on where it sits. False: batch-invariant calls keep the cuBLAS path.
BATCH_INVARIANT = True
# the kernel's config: 0 cooperative (128 x 256 tiles, 2 warpgroups per tile); 1 ping-pong (128 x 128 tiles), whose
# warpgroups alternate so one's epilogue hides under the other's mainloop; 2 config 0 in 2 x 1 clusters (TMA
# multicast of the weight tile). 1 and 2 are built for bfloat16 only (float16 runs 0).
CONFIG = 0
# the backward's gradient epilogue (with ENABLED): False keeps the float32 tile + grad kernel backward
GRAD = True
PARTIAL_BYTES = 256 << 20  # the [rows, tiles] float4 partials of one launch
_MIN_BLOCK = 128  # the GEMM's tile M
_DTYPES = (torch.bfloat16, torch.float16)

_lock = threading.Lock()
_records: collections.Counter = collections.Counter()  # (kernel, reason) -> calls: "epilogue" / "cublas"
_grad_records: collections.Counter = collections.Counter()  # the backwards': "epilogue" / "tile" (float32 tile)


def record(kernel: str, why: str = "") -> None:
    with _lock:
        _records[(kernel, why)] += 1


def record_grad(kernel: str, why: str = "") -> None:
    with _lock:
        _grad_records[(kernel, why)] += 1


def records() -> dict[tuple[str, str], int]:
    """How many forwards took each kernel and why not the epilogue GEMM: {(kernel, reason): calls}."""
    with _lock:
        return dict(_records)


def grad_records() -> dict[tuple[str, str], int]:
    """How many float32-logits backwards took the gradient epilogue ("epilogue") or the float32 tile and grad
    kernel ("tile"), and why: {(kernel, reason): calls}."""
    with _lock:
        return dict(_grad_records)


def reset_records() -> None:
    with _lock:
        _records.clear()
        _grad_records.clear()


def reason(rows2d: torch.Tensor, weight: torch.Tensor, bias, batch_invariant: bool, need_backward: bool, *,
           logits32: bool, adds_recompute: bool = False) -> str | None:
    """None where the epilogue GEMM computes this forward; else why not (one line). ``need_backward``: the
    backward will run, and needs the float32-logits GEMM (``blas.float32_output_gemm``) to match its softmax.
    Under ``"auto"`` only: ``logits32``, the call asked for float32 logits (``logits_dtype=torch.float32``);
    ``adds_recompute``, a backward after the epilogue forward (where one runs) would recompute logits that the
    cuBLAS path keeps (``linear_logp_loss`` where the gradient epilogue cannot run)."""
    if not ENABLED:
        return "switched off (rlkernel.ops.fused.epilogue_gemm.ENABLED)"
    if ENABLED is not True and ENABLED != "auto":
        raise ValueError(f"epilogue_gemm.ENABLED must be False, True or 'auto', not {ENABLED!r}")
    if rows2d.dtype not in _DTYPES:
        return f"{rows2d.dtype} inputs (bfloat16 / float16 only)"
    if ENABLED == "auto":
        if rows2d.shape[-1] > AUTO_MAX_HIDDEN:
            return f"ENABLED='auto': hidden size > {AUTO_MAX_HIDDEN} (the cuBLAS path measured faster at 4096)"
        if not logits32:
            return ("ENABLED='auto': 16-bit logits asked for (the epilogue's are float32: the call's log-probs would "
                    "depend on whether a backward runs)")
        if adds_recompute:
            return "ENABLED='auto': the backward would recompute the logits the cuBLAS path keeps (measured slower)"
    if batch_invariant and not BATCH_INVARIANT:
        return "batch_invariant=True (epilogue_gemm.BATCH_INVARIANT is off)"
    if rows2d.device.type != "cuda":  # the device queries below need one (tests stand the ops in on CPU)
        return f"{rows2d.device.type} tensors (a CUDA GPU only)"
    if torch.cuda.get_device_capability(rows2d.device) != (9, 0):
        return "needs a compute capability 9.0 GPU (wgmma, TMA)"
    if "sm_90a" not in _ext.built_archs():
        return "rlkernel._C was built without sm_90a code"
    if not torch.ops.rlkernel.linear_logp_epilogue_built():
        return "rlkernel._C was built without the CUTLASS headers (pip install 'rlkernel[cuda]')"
    n, hsize = rows2d.shape
    if hsize == 0 or hsize % 8 or (n > 1 and rows2d.stride(0) % 8):
        return "hidden size 0, or hidden size or row stride not a multiple of 8 (TMA's 16-byte strides)"
    if not weight.is_contiguous() or (bias is not None and not bias.is_contiguous()):
        return "weight or bias not contiguous"
    if rows2d.data_ptr() % 16 or weight.data_ptr() % 16:
        return "hidden or weight not 16-byte aligned (TMA)"
    if n > 2 ** 31 - 257 or weight.shape[0] > 2 ** 31 - 257:  # the kernel's int coordinates, one tile past V
        return "N or V >= 2^31 - 256"
    if need_backward:
        from rlkernel.ops.blas import float32_output_gemm

        why, _ = float32_output_gemm(rows2d.device, rows2d.dtype, batch_invariant)
        if why is not None:
            return f"the backward's float32 logits are unavailable: {why}"
    return None


def grad_reason(rows2d: torch.Tensor, weight: torch.Tensor, bias, batch_invariant: bool, need_b: bool,
                rows_opt) -> str | None:
    """None where the gradient epilogue computes a float32-logits backward's gradient tiles; else why not."""
    if not GRAD:
        return "switched off (rlkernel.ops.fused.epilogue_gemm.GRAD)"
    if rows_opt is not None:
        return "per-row temperature / softcap (the option kernels)"
    if need_b:
        return "a bias gradient (summed from the float32 tile)"
    # a float32-logits backward by definition, and it replaces the float32-output GEMM: no backward to ask about
    return reason(rows2d, weight, bias, batch_invariant, need_backward=False, logits32=True)


def config_for(dtype: torch.dtype) -> int:
    return CONFIG if dtype == torch.bfloat16 else 0


def block_rows(n: int, vocab: int, config: int = 0) -> int:
    """Rows per launch: the partials of one launch within PARTIAL_BYTES, a multiple of the tile M."""
    tiles = torch.ops.rlkernel.linear_logp_epilogue_tiles(vocab, config)
    rows = max(_MIN_BLOCK, PARTIAL_BYTES // (16 * tiles) // _MIN_BLOCK * _MIN_BLOCK)
    return max(1, min(n, rows))


def forward(rows2d, weight, bias, ids, temperature, ignore_index, return_entropy, address, seq, row0=0):
    """(logp, entropy (empty without), stats [n, 2]) of validated inputs that ``reason`` accepted; bad ids go to the
    error record at (address, seq), positions offset by ``row0``."""
    n = rows2d.shape[0]
    vocab = weight.shape[0]
    f32 = dict(dtype=torch.float32, device=rows2d.device)
    logp = torch.empty(n, **f32)
    entropy = torch.empty(n if return_entropy else 0, **f32)
    stats = torch.empty(n, 2, **f32)
    if n == 0:
        return logp, entropy, stats
    config = config_for(rows2d.dtype)
    block = block_rows(n, vocab, config)
    partial = torch.empty(block * torch.ops.rlkernel.linear_logp_epilogue_tiles(vocab, config) * 4, **f32)
    for r0 in range(0, n, block):
        r1 = min(n, r0 + block)
        torch.ops.rlkernel.linear_logp_epilogue(
            rows2d[r0:r1], weight, bias, ids[r0:r1], partial, logp[r0:r1],
            entropy[r0:r1] if return_entropy else entropy, stats[r0:r1], float(temperature), int(ignore_index),
            row0 + r0, address, seq, config)
    return logp, entropy, stats


def grad_tile(h, weight_chunk, bias_chunk, ids, stats, grad_logp, grad_entropy, entropy, col0, vocab, temperature,
              ignore_index, out):
    """out [rows, cols] (h's dtype) = the gradient of the rows' logp / entropy with respect to the chunk's logits
    h @ weight_chunk.T (+ bias_chunk), from the forward's stats; rows of h past len(ids) are padding (0)."""
    torch.ops.rlkernel.linear_logp_grad_epilogue(
        h, weight_chunk, bias_chunk, ids, stats, grad_logp, grad_entropy, entropy, col0, vocab, float(temperature),
        int(ignore_index), out, config_for(h.dtype))
