"""Second derivatives through the ops are refused with a clear error, never answered wrong (docs/contracts.md, 1).

Every op's backward is a first-order formula (torch code written out on the native path, a kernel on the fused one),
not something autograd can differentiate again: differentiated under ``create_graph=True`` it gave silent NaN (the
entropy's Hessian-vector product of a row holding a -inf logit, or of every row of ``linear_logp(batch_invariant=
True)``, whose padding is -inf), and torch's ``once_differentiable`` silently drops the term when the incoming
gradient needs none. ``refused(op)`` wraps a backward: when it runs under ``create_graph=True`` (the only time grad
mode is on in a backward) it computes the gradients without a graph and hands each through ``_Refused``, whose
backward raises a ``RuntimeError`` naming the op. ``_Refused`` takes the op's saved tensors as inputs, so autograd
reaches it from them (and cannot prune it) whichever tensor the second derivative is taken with respect to. A
``create_graph=True`` backward that is not differentiated again is unaffected.
"""
from __future__ import annotations

import functools

import torch

MESSAGE = "second derivatives are not supported (the backward is a first-order formula: differentiate it once)"


class _Refused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, grad, *inputs):
        ctx.op = op
        return grad  # an alias: no copy of the gradient

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(f"{ctx.op}: {MESSAGE}")


def _traced(tensors) -> bool:
    """torch.compile traces the backward (dynamo, or AOTAutograd with fake tensors): compiled graphs do not support
    double backward at all, so nothing is added there."""
    if torch.compiler.is_compiling():
        return True
    from torch._subclasses.fake_tensor import is_fake  # here: loaded by the time a create_graph backward runs

    return any(is_fake(t) for t in tensors)


def refused(op: str):
    """Decorator of an autograd backward ``(ctx, *grad_outputs) -> grads``: under ``create_graph=True`` its gradients
    raise ``RuntimeError("<op>: second derivatives are not supported ...")`` when differentiated."""

    def wrap(backward):
        @functools.wraps(backward)
        def run(ctx, *grad_outputs):
            if not torch.is_grad_enabled():  # a plain backward: nothing to do
                return backward(ctx, *grad_outputs)
            # unpacked before the backward runs: the fused in-place backward overwrites a saved tensor
            inputs = tuple(t for t in (*ctx.saved_tensors, *grad_outputs)
                           if isinstance(t, torch.Tensor) and t.requires_grad)
            if not inputs or _traced(inputs):
                return backward(ctx, *grad_outputs)
            with torch.no_grad():
                grads = backward(ctx, *grad_outputs)
            one = not isinstance(grads, tuple)
            grads = (grads,) if one else grads
            out = tuple(_Refused.apply(op, g.detach(), *inputs) if isinstance(g, torch.Tensor) else g for g in grads)
            return out[0] if one else out

        return run

    return wrap
