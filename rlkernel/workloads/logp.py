"""The logp family (``rlkernel.logp`` on logits): ``logp-{native,fused}`` and ``logp-{native,fused}-bwd``.

The ops are imported inside the steps, at call time: importing the registry imports no op module, and a test that
patches ``rlkernel.logp`` reaches the workloads.
"""
from __future__ import annotations

import torch

from rlkernel.numerics import LOGP_TOLERANCE
from rlkernel.workloads.common import _generator, _logits, _mismatch, _size
from rlkernel.workloads.registry import Shape, Workload

# ---- inputs -------------------------------------------------------------------------------------------

def _logp_inputs(shape, dtype, device, seed, *, backward=False):
    g = _generator(device, seed + 1)
    logits = _logits(shape, dtype, device, seed)
    ids = torch.randint(0, shape.vocab_size, (shape.rows,), generator=g, device=device)
    inputs = {"logits": logits, "ids": ids, "temperature": shape.temperature}
    if backward:
        logits.requires_grad_(True)
        inputs["grad"] = torch.randn(shape.rows, generator=g, device=device, dtype=torch.float32)
    return inputs


# ---- steps --------------------------------------------------------------------------------------------

def _logp_step(backend):
    def step(inp):
        from rlkernel import logp

        with torch.no_grad():
            return logp(inp["logits"], inp["ids"], temperature=inp["temperature"], backend=backend)
    return step


def _logp_bwd_step(backend):
    def step(inp):
        from rlkernel import logp

        logits = inp["logits"]
        logits.grad = None  # no accumulation kernel between repetitions
        out = logp(logits, inp["ids"], temperature=inp["temperature"], backend=backend)
        out.backward(inp["grad"])
        return out.detach(), logits.grad
    return step


# ---- checks against native on the same inputs ---------------------------------------------------------

def _compare_logp(inp) -> str | None:
    from rlkernel import logp

    with torch.no_grad():
        got = logp(inp["logits"], inp["ids"], temperature=inp["temperature"], backend="auto")
        ref = logp(inp["logits"], inp["ids"], temperature=inp["temperature"], backend="native")
    return _mismatch("logp", got, ref, *LOGP_TOLERANCE)


def _compare_logp_bwd(inp) -> str | None:
    out, grad = _logp_bwd_step("auto")(inp)
    out, grad = out.clone(), grad.clone()
    ref_out, ref_grad = _logp_bwd_step("native")(inp)
    inp["logits"].grad = None
    # gradients are p - onehot in [-1, 1], rounded to the logits' dtype on the way out
    eps = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}.get(grad.dtype, 1e-5)
    return _mismatch("logp", out, ref_out, *LOGP_TOLERANCE) or _mismatch("grad", grad, ref_grad, eps, eps)


# ---- bytes and flops ----------------------------------------------------------------------------------

def _logp_bytes(s: Shape, dtype) -> int:
    return s.rows * s.vocab_size * _size(dtype) + s.rows * (8 + 4)  # logits once, ids in, logp out


def _logp_bwd_bytes(s: Shape, dtype) -> int:
    # forward reads the logits; backward reads them again and writes the gradient
    return 3 * s.rows * s.vocab_size * _size(dtype) + s.rows * (8 + 4 + 4 + 4)


def _logp_flops(s: Shape, dtype) -> int:
    return 5 * s.rows * s.vocab_size  # scale, max, subtract, exp, add per logit (exp counted as one)


def _logp_bwd_flops(s: Shape, dtype) -> int:
    return 5 * s.rows * s.vocab_size + 5 * s.rows * s.vocab_size  # forward, then scale/exp/subtract/mul per logit


def workloads(path: str, backend: str) -> list[Workload]:
    """This family's workloads of one path, in registration order: forward, then forward and backward."""
    fused = path == "fused"
    return [
        Workload(
            name=f"logp-{path}", op="logp", path=path, backend=backend,
            fused_ops=("logp.forward",) if fused else (),
            description=f"per-token log-probs, forward only, {path} path",
            build=_logp_inputs, step=_logp_step(backend), count_bytes=_logp_bytes, count_flops=_logp_flops,
            compare=_compare_logp if fused else None),
        Workload(
            name=f"logp-{path}-bwd", op="logp+backward", path=path, backend=backend,
            fused_ops=("logp.forward", "logp.backward") if fused else (),
            description=f"per-token log-probs, forward and backward, {path} path",
            build=lambda s, d, dev, seed: _logp_inputs(s, d, dev, seed, backward=True),
            step=_logp_bwd_step(backend), count_bytes=_logp_bwd_bytes, count_flops=_logp_bwd_flops,
            compare=_compare_logp_bwd if fused else None, has_backward=True),
    ]
