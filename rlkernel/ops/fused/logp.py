"""The fused CUDA backend of rlkernel.logp: fake kernels, autograd, and the call the dispatcher makes.

The ops (registered in csrc/logp_op.cpp, kernels in csrc/include/rlkernel/logp_kernels.cuh):

- ``torch.ops.rlkernel.logp_forward(logits[N, V], ids[N] int64, temperature, ignore_index, compute_entropy,
  error_record=0, error_seq=0, error_op=1, inplace_backward=False, requested="fused") -> (logp[N] f32,
  entropy[N] f32 (or [0] without entropy), stats[N, 2] f32)``. ``stats`` = (r, log2 s) per row in base-2 units of
  x / T (lse = ln2 * (r + log2 s)). A row whose id is outside [0, V) (not ignore_index) is NaN and is reported to
  the device error record at ``error_record`` (an address; 0: nowhere) under call ``error_seq`` (rlkernel.errors).
  ``inplace_backward`` and ``requested`` are read by the autograd formula only.
- ``logp_backward(grad_logp?, grad_entropy?, logits, ids, stats, entropy, temperature, ignore_index) -> grad``
- ``logp_backward_inplace(...)``: the same, writing the gradient into ``logits`` (**the logits are overwritten**).

Registration here happens once, after the extension loaded (the schemas live in C++).
"""
from __future__ import annotations

import torch

from rlkernel import _ext, dispatch, errors
from rlkernel.ops import second_order
from rlkernel.ops.rows import as_lead, as_rows, eager_entry_ok, flat_ids, report_as_logp_call, row_grad

_registered = False
_FORWARD = None  # torch.ops.rlkernel.logp_forward.default once registered
_EAGER = None  # rlkernel._C.logp_forward_eager: the same C++ without torch's op dispatcher (csrc/python_module.cpp)


def _fwd_fake(logits, token_ids, temperature, ignore_index, compute_entropy, error_record=0, error_seq=0,
              error_op=1, inplace_backward=False, requested="fused"):
    n = logits.shape[0]
    f32 = dict(dtype=torch.float32, device=logits.device)
    return (torch.empty((n,), **f32), torch.empty((n if compute_entropy else 0,), **f32),
            torch.empty((n, 2), **f32))


def _bwd_fake(grad_logp, grad_entropy, logits, token_ids, stats, entropy, temperature, ignore_index):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _bwd_inplace_fake(grad_logp, grad_entropy, logits, token_ids, stats, entropy, temperature, ignore_index):
    return None


def _setup_context(ctx, inputs, output):
    logits, ids, temperature, ignore_index, compute_entropy, _, _, _, inplace_backward, requested = inputs
    _, entropy, stats = output
    ctx.mark_non_differentiable(stats)
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no entropy term in the kernel
    ctx.save_for_backward(logits, ids, stats, entropy)
    ctx.temperature, ctx.ignore_index = temperature, ignore_index
    ctx.compute_entropy, ctx.inplace, ctx.requested = compute_entropy, inplace_backward, requested


_NO_GRADS = (None,) * 10  # one per input of logp_forward


def _tracing(t: torch.Tensor) -> bool:
    """Whether this backward is being traced rather than run: AOTAutograd traces the joint graph with fake tensors,
    and there torch.compiler.is_compiling() can be False (seen with torch 2.11), which once counted a traced
    backward as a call."""
    from torch._subclasses.fake_tensor import is_fake  # here, not at import: it is loaded by the time it matters

    return torch.compiler.is_compiling() or is_fake(t)


@second_order.refused("logp.backward")
def _backward(ctx, grad_logp, grad_entropy, grad_stats):
    logits, ids, stats, entropy = ctx.saved_tensors
    if not ctx.compute_entropy or (grad_entropy is not None and grad_entropy.numel() == 0):
        grad_entropy = None
    if grad_logp is None and grad_entropy is None:
        return _NO_GRADS
    if not _tracing(logits):  # compiled: counted with the forward call (rlkernel.ops.logp)
        dispatch.record("logp.backward", ctx.requested, "fused", "fused")
    args = (row_grad(grad_logp), row_grad(grad_entropy), logits, ids, stats, entropy, ctx.temperature,
            ctx.ignore_index)
    if ctx.inplace:
        torch.ops.rlkernel.logp_backward_inplace(*args)
        grad = logits
    else:
        grad = torch.ops.rlkernel.logp_backward(*args)
    return (grad,) + _NO_GRADS[1:]


def ensure_registered() -> None:
    """Load rlkernel._C (raises rlkernel._ext.ExtensionNotBuilt) and register fakes and autograd once."""
    global _registered
    if _registered:
        return
    module = _ext.load()
    torch.library.register_fake("rlkernel::logp_forward")(_fwd_fake)
    torch.library.register_fake("rlkernel::logp_backward")(_bwd_fake)
    torch.library.register_fake("rlkernel::logp_backward_inplace")(_bwd_inplace_fake)
    torch.library.register_autograd("rlkernel::logp_forward", _backward, setup_context=_setup_context)
    global _FORWARD, _EAGER
    _FORWARD = torch.ops.rlkernel.logp_forward.default  # the overload itself: no packet lookup per call
    _EAGER = module.logp_forward_eager
    _registered = True


def forward_op():
    """``torch.ops.rlkernel.logp_forward.default``, registered (raises rlkernel._ext.ExtensionNotBuilt): for callers
    that run the forward kernel themselves, between their own GEMMs (rlkernel.ops.linear_logp_loss_chunks)."""
    if not _registered:
        ensure_registered()
    return _FORWARD


def logp_fused(logits: torch.Tensor, token_ids: torch.Tensor, *, temperature: float, ignore_index: int,
               return_entropy: bool, inplace_backward: bool, requested: str = "auto", report_as=None):
    """Fused log-probs (and entropy) of validated CUDA inputs; returns (logp, entropy or None), float32. No host sync:
    bad ids go to the device error record (``rlkernel.errors``).

    ``inplace_backward=True``: the backward writes the gradient into the logits' storage (when ``as_rows`` could
    view them; a non-collapsible input is copied first and the copy is overwritten instead). ``requested`` is the
    backend the caller asked for; the backward's dispatch record repeats it. ``report_as``: (record address,
    sequence number, error kind) of a calling op whose errors these are (the sampler's log-probs), else this call
    is its own ``logp.forward`` call.
    """
    if not _registered:
        ensure_registered()
    lead = logits.shape[:-1]
    rows, ids = as_rows(logits), flat_ids(token_ids)
    report_as, sync = report_as_logp_call(logits, report_as)
    if not (torch.is_grad_enabled() and logits.requires_grad) and eager_entry_ok(rows, ids):
        # no gradient wanted, plain tensors, nothing tracing: straight into the extension, past torch's op dispatcher
        # and the autograd wrapper register_autograd adds (most of a small call's host time: docs/benchmarks.md)
        logp, entropy, _ = _EAGER(rows, ids, temperature, ignore_index, return_entropy, *report_as)
    else:
        logp, entropy, _ = _FORWARD(rows, ids, temperature, ignore_index, return_entropy, *report_as,
                                    inplace_backward, requested)
    errors.after_call(logits.device, sync)
    return as_lead(logp, lead), (as_lead(entropy, lead) if return_entropy else None)


# register as soon as the extension is loaded (now for an in-tree build, else after the first call loads or builds
# it), so torch.compile and opcheck see the fake kernels; importing never builds
_ext.when_loaded(ensure_registered)

