"""The linear-logp family (``rlkernel.linear_logp``: log-probs and entropy from hidden states and the LM head):
``linear-logp-{native,fused}`` (forward) and ``linear-logp-fused-bwd``.

The op is imported inside the steps, at call time: importing the registry imports no op module, and a test that
patches ``rlkernel.linear_logp`` reaches the workloads.
"""
from __future__ import annotations

import torch

from rlkernel.numerics import LOGP_TOLERANCE
from rlkernel.workloads.common import _generator, _mismatch, _size
from rlkernel.workloads.registry import Shape, Workload

# Shape: rows = batch_size * seq_len hidden states of width hidden_size, vocab_size rows of the head's weight.

def _linear_inputs(s: Shape, dtype, device, seed, *, backward=False):
    g = _generator(device, seed)
    h = s.hidden_size
    hidden = torch.randn(s.rows, h, generator=g, device=device).to(dtype)
    # weight rows of norm ~2: logits with a spread like _logits' (never zeros)
    weight = (torch.randn(s.vocab_size, h, generator=g, device=device) * (2.0 / h ** 0.5)).to(dtype)
    ids = torch.randint(0, s.vocab_size, (s.rows,), generator=g, device=device)
    inputs = {"hidden": hidden, "weight": weight, "ids": ids, "temperature": s.temperature}
    if backward:
        hidden.requires_grad_(True)
        weight.requires_grad_(True)
        inputs["grad"] = torch.randn(s.rows, generator=g, device=device)
        inputs["grad_entropy"] = torch.randn(s.rows, generator=g, device=device) * 0.01
    return inputs


def _linear_step(backend):
    def step(inp):
        from rlkernel import linear_logp

        with torch.no_grad():
            return linear_logp(inp["hidden"], inp["weight"], inp["ids"], temperature=inp["temperature"],
                               return_entropy=True, backend=backend)
    return step


def _linear_bwd_step(backend):
    def step(inp):
        from rlkernel import linear_logp

        hidden, weight = inp["hidden"], inp["weight"]
        hidden.grad = weight.grad = None  # no accumulation kernel between repetitions
        lp, ent = linear_logp(hidden, weight, inp["ids"], temperature=inp["temperature"], return_entropy=True,
                              backend=backend)
        torch.autograd.backward([lp, ent], [inp["grad"], inp["grad_entropy"]])
        return lp.detach(), ent.detach(), hidden.grad, weight.grad
    return step


def _linear_logit_bound(inp) -> float:
    """The largest |logit| / T over a sample of up to 64 rows (the rows are i.i.d.; doubled for the others)."""
    h = inp["hidden"][:64].detach().float()
    return 2.0 * float((h @ inp["weight"].detach().float().t()).abs().max()) / inp["temperature"]


def _linear_tolerance(inp, dtype) -> float:
    # fused and native GEMMs may round a logit differently: one unit roundoff u of |x| per logit moves a log-prob by
    # at most 2 u max|x| / T; plus the kernels' float32 tolerance
    u = {torch.float32: 2.0 ** -24 * inp["hidden"].shape[1], torch.float16: 2.0 ** -11,
         torch.bfloat16: 2.0 ** -8}.get(dtype, 1e-12)
    return 2 * u * _linear_logit_bound(inp) + LOGP_TOLERANCE[0]


def _compare_linear(inp) -> str | None:
    got_lp, got_ent = _linear_step("auto")(inp)
    ref_lp, ref_ent = _linear_step("native")(inp)
    atol = _linear_tolerance(inp, inp["hidden"].dtype)
    return (_mismatch("linear_logp", got_lp, ref_lp, atol, LOGP_TOLERANCE[1])
            or _mismatch("entropy", got_ent, ref_ent, atol * (1 + _linear_logit_bound(inp)), LOGP_TOLERANCE[1]))


def _compare_linear_bwd(inp) -> str | None:
    got = [t.clone() for t in _linear_bwd_step("auto")(inp)]
    ref = _linear_bwd_step("native")(inp)
    inp["hidden"].grad = inp["weight"].grad = None
    dtype = inp["hidden"].dtype
    atol = _linear_tolerance(inp, dtype)
    mismatch = _mismatch("linear_logp", got[0], ref[0], atol, LOGP_TOLERANCE[1])
    # gradients: rounded to the dtype (u) at the logits' gradient and at the output, plus the logits' own rounding
    # carried through p (the logp tolerance, relative): a bound relative to the largest gradient element
    u = {torch.float32: 1e-5, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}.get(dtype, 1e-12)
    for name, g, r in (("hidden grad", got[2], ref[2]), ("weight grad", got[3], ref[3])):
        eps = (4 * u + 2 * atol) * float(r.abs().max()) + 1e-6
        mismatch = mismatch or _mismatch(name, g, r, eps, 0.0)
    return mismatch


def _linear_bytes(s: Shape, dtype) -> int:
    # hidden and weight read once, ids in, logp and entropy out
    return (s.rows + s.vocab_size) * s.hidden_size * _size(dtype) + s.rows * (8 + 4 + 4)


def _linear_bwd_bytes(s: Shape, dtype) -> int:
    # forward and backward each read hidden and weight; the backward writes their gradients; row vectors
    return 3 * (s.rows + s.vocab_size) * s.hidden_size * _size(dtype) + s.rows * (8 + 4 * 6)


def _linear_flops(s: Shape, dtype) -> int:
    return 2 * s.rows * s.hidden_size * s.vocab_size + 5 * s.rows * s.vocab_size  # the GEMM, then the softmax pass


def _linear_bwd_flops(s: Shape, dtype) -> int:
    # four GEMMs (forward, recompute, dH, dW) and the softmax pass of the forward and of the logits' gradient
    return 4 * 2 * s.rows * s.hidden_size * s.vocab_size + 10 * s.rows * s.vocab_size


def _linear_shape_error(s: Shape) -> str | None:
    return None if s.hidden_size >= 1 else f"linear-logp needs hidden_size >= 1, got {s.hidden_size}"


def workloads(path: str, backend: str) -> list[Workload]:
    """This family's workloads of one path, in registration order: the forward, then (fused only) the backward."""
    forward = Workload(
        name=f"linear-logp-{path}", op="linear_logp", path=path, backend=backend,
        fused_ops=("linear_logp.forward",) if path == "fused" else (),
        description=f"log-probs + entropy from hidden states and the LM head (rlkernel.linear_logp), forward, "
                    f"{path} path",
        build=_linear_inputs, step=_linear_step(backend), count_bytes=_linear_bytes, count_flops=_linear_flops,
        compare=_compare_linear if path == "fused" else None, check_shape=_linear_shape_error)
    if path != "fused":
        return [forward]
    return [forward, Workload(
        name="linear-logp-fused-bwd", op="linear_logp+backward", path="fused", backend="auto",
        fused_ops=("linear_logp.forward", "linear_logp.backward"),
        description="log-probs + entropy from hidden states and the LM head, forward and backward (hidden, weight)",
        build=lambda s, d, dev, seed: _linear_inputs(s, d, dev, seed, backward=True), step=_linear_bwd_step("auto"),
        count_bytes=_linear_bwd_bytes, count_flops=_linear_bwd_flops, compare=_compare_linear_bwd, has_backward=True,
        check_shape=_linear_shape_error)]
