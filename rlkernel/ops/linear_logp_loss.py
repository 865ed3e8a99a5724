"""rlkernel.linear_logp_loss: a per-token loss of log-probs (and entropy) straight from hidden states, with the
gradients of hidden, weight and bias computed during its one pass over the tokens (the fused-loss form of
``rlkernel.linear_logp``, as Liger-Kernel's fused losses do).

Per chunk of tokens: the chunk's full-vocabulary logits by one GEMM into a [chunk, V] buffer, their log-probs and
entropy, ``loss_fn`` and its autograd for d loss / d (logp, entropy), the logits' gradient written over the logits,
then dH = G @ W and dW += G^T @ H. Three GEMMs per chunk, no recompute, never an N x V tensor. The fused backend
runs the project's logp kernels (``torch.ops.rlkernel.logp_forward`` / ``logp_backward_inplace``) between cuBLAS
GEMMs; the native one the same chunking in PyTorch (float32 softmax of one chunk at a time). The gradients are
handed to autograd by ``_PrecomputedGrads``, whose backward only scales them by the incoming gradient.
"""
from __future__ import annotations

import inspect
import math
import numbers

import torch

from rlkernel import dispatch
from rlkernel.ops import blas, precision, row_mask, second_order, sharded
from rlkernel.ops import linear_logp_loss_chunks as chunks
from rlkernel.ops.linear_options import check_options, fallback_for
from rlkernel.validate import check_linear_args, check_logits_dtype

OP = "linear_logp_loss"
REDUCTIONS = ("sum", "mean")
CHUNK_BYTES = 1 << 30  # the default chunk holds about 1 GiB of logits (4096 tokens of a 128256 vocab in bf16)


def check_chunk_size(chunk_size) -> None:
    """A positive integer or None (the integrations check it when they are applied, before any forward)."""
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral)
                                   or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive integer or None, got {chunk_size!r}")


def check_args(hidden, weight, token_ids, loss_fn, bias, temperature, ignore_index, reduction, chunk_size) -> None:
    """Every argument, before any work (tensor metadata only on CUDA: no host sync). On CPU the ids too."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (logp, entropy, chunk_slice) -> per-token losses, got "
                        f"{type(loss_fn).__name__}")
    check_loss_fn_arity(loss_fn)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    check_chunk_size(chunk_size)
    if token_ids is None:  # linear_logp takes None (entropy alone); a loss needs the ids
        raise TypeError("token_ids must be a torch.Tensor, got NoneType (linear_logp_loss needs the ids)")
    check_linear_args(hidden, weight, token_ids, bias, temperature, ignore_index, OP)  # last: it reads CPU ids


def check_loss_fn_arity(loss_fn) -> None:
    """A loss_fn that cannot take the three arguments it is called with is named before any work (a TypeError
    from inside the chunk loop would not say what the op passes)."""
    try:
        sig = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # a builtin or C callable without a signature: it is called as is
        return
    try:
        sig.bind(None, None, None)
    except TypeError:
        raise TypeError(f"loss_fn is called as loss_fn(logp, entropy, chunk_slice) (the chunk's log-probs, "
                        f"entropies and its slice of the flat tokens), but its signature is {sig}; take all three "
                        f"(e.g. lambda logp, entropy, chunk_slice: -logp * adv[chunk_slice])") from None


def default_chunk(n: int, vocab: int, itemsize: int) -> int:
    """Tokens per chunk: about CHUNK_BYTES of logits, a multiple of 256 when that large (whole GEMM tiles)."""
    c = max(1, CHUNK_BYTES // max(1, vocab * itemsize))
    if c >= 256:
        c -= c % 256
    return max(1, min(c, n))


class _PrecomputedGrads(torch.autograd.Function):
    """Connects the loss to hidden, weight and bias; its backward scales the gradients computed in the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, run, regather, *anchors):
        loss, grads = run(ctx.needs_input_grad[:3])
        ctx.grads, ctx.regather = grads, regather
        ctx.save_for_backward(*anchors)  # what a refused second derivative hangs on (rlkernel.ops.second_order)
        return loss

    @staticmethod
    @second_order.refused("linear_logp_loss")
    def backward(ctx, grad_loss):
        if ctx.grads is None:
            raise RuntimeError("linear_logp_loss: backward ran twice; its gradients were computed once, in the forward")
        grads, ctx.grads = ctx.grads, None
        # in place: the buffers are ours, and a copy of dW would cost V x H more memory
        scaled = tuple(g.mul_(grad_loss) if g is not None else None for g in grads)
        # a ZeRO-3 weight partitioned again since the forward: whole again (no compute) for autograd to accumulate
        # the whole gradient into it (rlkernel.ops.sharded)
        with sharded.regathered(ctx.regather):
            return (*scaled, None, None, None, None, None)


def linear_logp_loss(hidden: torch.Tensor, weight: torch.Tensor, token_ids: torch.Tensor, loss_fn, *, bias=None,
                     temperature: float = 1.0, ignore_index: int = -100, reduction: str = "sum",
                     chunk_size: int | None = None, backend: str = "auto", require_fused: bool = False,
                     logits_dtype: torch.dtype | None = None, softcap: float | None = None,
                     logit_scale: float = 1.0, mask: torch.Tensor | None = None,
                     grad_accumulation: str = "float32", top_k=0, top_p=1.0, min_p=0.0):
    """The loss ``reduce(loss_fn(logp, entropy, chunk_slice))`` over the tokens, with ``logp`` and ``entropy`` those
    of ``log_softmax((hidden @ weight.T + bias) / temperature)`` (as ``rlkernel.linear_logp`` gives them), without
    ever holding the N x V logits.

    ``hidden [..., H]``, ``weight [V, H]`` (the LM head's layout), ``bias [V]`` or None, one device, any floating
    dtypes (one compute dtype for the GEMMs, gradients in each input's dtype, ``grad_accumulation`` "float32" or
    "input" for dW / db, as for ``rlkernel.linear_logp``; under autocast ``loss_fn`` still runs under it);
    ``token_ids`` of shape ``hidden.shape[:-1]``. ``mask`` (bool, ``hidden.shape[:-1]``): False rows are skipped (no
    GEMM work, no loss, no gradient); ``chunk_slice`` is then an int64 tensor of the chunk's flat token positions
    (indexing per-token inputs as the slice does). A DTensor weight is gathered once, a ZeRO-3 one for the call (its
    gradients are computed in the forward: no second gather). Tokens are taken flat, in chunks of ``chunk_size``
    (default: about 1 GiB of logits). ``loss_fn(logp, entropy, chunk_slice)`` gets the chunk's float32 ``[c]``
    log-probs and entropies (float64 for float64 inputs) and the ``slice`` of the flat tokens they belong to (index
    per-token inputs such as advantages or old log-probs with it), and returns the chunk's per-token losses ``[c]``:
    plain differentiable torch code, run outside the op's NVTX ranges. Rows whose id is ``ignore_index`` get logp
    and entropy 0 and their losses are left out (no gradient). ``reduction``: "sum" of the per-token losses, or
    "mean" over the tokens that are not ignored (sum / max(count, 1)). Returns the reduced loss, a 0-dim tensor.

    The gradients of hidden, weight and bias (those that require grad) are computed during the call, and
    ``loss.backward()`` only scales them by the incoming gradient: backward once. ``logits_dtype=torch.float32``:
    the chunk's logits of 16-bit inputs stay float32 (as for ``rlkernel.linear_logp``; the default chunk then holds
    half the tokens). ``loss_fn`` gets gradients only for logp and entropy (tensors it closes over get none from
    this op). ``backend``: "auto", "fused" or "native", as for ``rlkernel.logp``; one dispatch record
    ``linear_logp_loss`` per call. On CUDA nothing waits for the GPU: an id outside [0, V) gives NaN logp and
    entropy (and NaN gradients) and goes to the device error record (``rlkernel.check_errors``); on CPU it raises
    ``IndexError`` at once. See docs/contracts.md.

    ``temperature`` a number or a per-row tensor of shape ``hidden.shape[:-1]`` (or 0-dim), ``logit_scale`` and
    ``softcap``: as for ``rlkernel.linear_logp`` (``z' = softcap * tanh(z * logit_scale / softcap) / T``, with
    their gradients); fused by linear_logp's option kernels (a softcap keeps float32 logits there).

    With ``top_k`` / ``top_p`` / ``min_p`` (numbers or per-row tensors) or a zero temperature: ``logp``
    and ``entropy`` are the processed ones of ``rlkernel.linear_logp`` with the same filters (the sampler's kept
    set; ``-inf`` log-prob off it: mask it in ``loss_fn``), computed by that op's processed mode, and the gradients
    flow by plain autograd (backward recomputes the logits). See docs/contracts.md.
    """
    from rlkernel.ops import linear_logp_processed as proc

    acc = precision.check_grad_accumulation(grad_accumulation)  # both modes (the processed one does not use it yet)
    if proc.wants_processed(temperature, top_k, top_p, min_p, None, None):
        proc.check_plain_options(softcap, logit_scale, (), token_ids, OP)
        if mask is not None:
            raise ValueError(f"{OP}: mask cannot be combined with the processed mode (top_k / top_p / min_p or "
                             f"temperature 0) yet; give masked rows ignore_index instead")
        # the temperature is checked with the filters (0 and per-row tensors are allowed there)
        check_args(hidden, weight, token_ids, loss_fn, bias, 1.0, ignore_index, reduction, chunk_size)
        return proc.processed_loss(hidden, weight, token_ids, loss_fn, bias=bias, temperature=temperature,
                                   top_k=top_k, top_p=top_p, min_p=min_p, ignore_index=ignore_index,
                                   reduction=reduction, chunk_size=chunk_size, backend=backend,
                                   require_fused=require_fused, logits_dtype=logits_dtype)
    logits32 = check_logits_dtype(logits_dtype)
    weight, bias = sharded.full(weight), sharded.full(bias)
    zero = sharded.zero3_partitioned(weight, bias)
    with sharded.gathered(zero):  # the gradients are computed inside: no second gather to compute them
        return _linear_logp_loss(hidden, weight, token_ids, loss_fn, bias, temperature, ignore_index, reduction,
                                 chunk_size, backend, require_fused, logits32, mask, acc, zero, softcap, logit_scale)


def _linear_logp_loss(hidden, weight, token_ids, loss_fn, bias, temperature, ignore_index, reduction, chunk_size,
                      backend, require_fused, logits32, mask, acc, zero, softcap, logit_scale):
    check_args(hidden, weight, token_ids, loss_fn, bias, temperature, ignore_index, reduction, chunk_size)
    row_mask.check_mask(mask, hidden, OP)
    opts = None
    cd = precision.compute_dtype(hidden, weight, bias)
    # on every row, before a mask compacts them (a bad per-row temperature named by its own row, as linear_logp's)
    if isinstance(temperature, torch.Tensor) or softcap is not None or not (type(logit_scale) is float
                                                                            and logit_scale == 1.0):
        opts, _ = check_options(hidden, temperature, softcap, logit_scale, (), True, OP, compute=cd)
    if mask is not None:
        idx = row_mask.kept_rows(mask, hidden.device)
        if idx is None:  # a device mask under CUDA-graph capture: its rows ignored, no compaction
            token_ids = row_mask.as_ignored(token_ids, mask, int(ignore_index))
        else:
            opts = row_mask.compact_options(opts, idx)  # a per-row temperature: its kept rows
            hidden, token_ids = row_mask.compact(hidden, token_ids, idx)
            user_fn = loss_fn

            def loss_fn(logp, entropy, chunk_slice):  # the chunk's flat positions in the uncompacted tokens
                return user_fn(logp, entropy, idx[chunk_slice])
    logits32 = logits32 and cd in blas.SIXTEEN_BIT  # float32 / float64 logits already are
    rec = (opts is not None and fallback_for(OP, opts, backend, require_fused, hidden.device, cd, loss=True)
           or logits32 and blas.float32_fallback(OP, backend, require_fused, hidden.device, cd)
           or dispatch.resolve(OP, backend, require_fused, hidden.device, cd))
    n, vocab = math.prod(hidden.shape[:-1]), weight.shape[0]
    # the fused pass's number (a logit_scale folded in: z * scale / T = z / (T / scale)); the native one takes opts
    fused_t = temperature if opts is None else 1.0 if opts.per_row else opts.temperature / opts.scale
    rows_opt = None
    if rec.status == "fused" and opts is not None and (opts.per_row or opts.softcap is not None):
        from rlkernel.ops.fused.linear_logp_options import prepare  # the option kernels' inputs, bad rows reported

        _, _, rows_opt, capped = prepare(opts, hidden, token_ids, hidden.shape[:-1], vocab, op=OP)
        logits32 = logits32 or (capped and cd in blas.SIXTEEN_BIT)  # softcapped logits: float32, as linear_logp's
    spec = chunks.Spec(loss_fn=loss_fn, opts=opts, rows=rows_opt, temperature=float(fused_t),
                       ignore_index=int(ignore_index),
                       mean=reduction == "mean", ids_shape=token_ids.shape,
                       chunk=int(chunk_size) if chunk_size is not None else
                       default_chunk(n, vocab, 4 if logits32 else cd.itemsize), logits32=logits32,
                       compute=cd, accumulation=acc, autocast=precision.autocast_state(hidden.device))
    step = chunks.fused_pass if rec.status == "fused" else chunks.native_pass

    def run(needs):
        return step(hidden, weight, bias, token_ids, spec, needs)

    tensors = (hidden, weight) + ((bias,) if bias is not None else ())
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        # empty copies of the inputs that need a gradient: on their graphs, holding none of their memory (no kernel)
        anchors = tuple(t.as_strided((0,), (1,)).clone() if t is not None and t.requires_grad else None
                        for t in (hidden, weight, bias))
        return _PrecomputedGrads.apply(hidden, weight, bias, run, zero, *anchors)
    loss, _ = run((False, False, False))
    return loss
