"""The workload registry: the one place a workload is defined (docs/contracts.md, section 4).

The profile suite, ``pipelines.capture`` and the GRPO example all run workloads from here, so a CSV row
and a trace of the same workload measure the same thing.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rlkernel import dispatch, errors
from rlkernel.numerics import DTYPES, LOGP_TOLERANCE  # noqa: F401  (DTYPES: the registry's public name too)
from rlkernel.nvtx_ranges import workload_range


@dataclass(frozen=True)
class Shape:
    batch_size: int
    seq_len: int
    vocab_size: int
    top_k: int = 50
    top_p: float = 0.9
    temperature: float = 1.0
    min_p: float = 0.0
    per_row: bool = False  # sampling: the settings as per-row tensors, with per-row seeds (the same values per row)
    hidden_size: int = 1024  # the LM head's input width (linear-logp-* workloads only)

    @property
    def rows(self) -> int:
        return self.batch_size * self.seq_len

    def as_dict(self) -> dict:
        return {"batch_size": self.batch_size, "seq_len": self.seq_len, "vocab_size": self.vocab_size,
                "top_k": self.top_k, "top_p": self.top_p, "temperature": self.temperature, "min_p": self.min_p,
                "per_row": self.per_row, "hidden_size": self.hidden_size}


@dataclass(frozen=True)
class Workload:
    name: str
    op: str  # logp | logp+backward | sample | grpo-step
    path: str  # native | fused
    backend: str  # the backend argument the ops are called with
    fused_ops: tuple[str, ...]
    description: str
    build: Callable[[Shape, torch.dtype, torch.device, int], dict]
    step: Callable[[dict], Any]
    count_bytes: Callable[[Shape, torch.dtype], int]
    count_flops: Callable[[Shape, torch.dtype], int]
    compare: Callable[[dict], str | None] | None = None
    has_backward: bool = False
    uses_seq_len: bool = True
    fused_patterns: tuple[str, ...] = field(default=("rlkernel_*",))
    check_shape: Callable[[Shape], str | None] | None = None  # why a shape cannot run, for CLIs to refuse it early

    def __post_init__(self):
        if self.path not in ("native", "fused"):
            raise ValueError(f"{self.name}: path must be native or fused")
        if (self.path == "fused") != bool(self.fused_ops):
            raise ValueError(f"{self.name}: fused workloads list their fused_ops, native ones none")
        unknown = set(self.fused_ops) - set(dispatch.OPS)
        if unknown:
            raise ValueError(f"{self.name}: unknown ops in fused_ops: {sorted(unknown)}")

    def shape_error(self, shape: Shape) -> str | None:
        """None, or one line saying why this workload cannot run at ``shape`` (checked before any work)."""
        return self.check_shape(self.effective_shape(shape)) if self.check_shape else None

    def effective_shape(self, shape: Shape) -> Shape:
        """Sampling draws one token per row: seq_len is 1 whatever was asked."""
        if self.uses_seq_len:
            return shape
        return dataclasses.replace(shape, seq_len=1)

    def make_inputs(self, shape: Shape, dtype: torch.dtype, device, seed: int) -> dict:
        return self.build(self.effective_shape(shape), dtype, torch.device(device), seed)

    def run(self, inputs: dict):
        """One repetition's work, without the workload range."""
        return self.step(inputs)

    def repetition(self, inputs: dict):
        """One repetition inside its workload range; a backward runs on this thread (contracts, section 3)."""
        single = torch.autograd.set_multithreading_enabled(False) if self.has_backward else contextlib.nullcontext()
        with single, workload_range(self.name):
            return self.step(inputs)

    def check(self, inputs: dict) -> str | None:
        """None, or one line saying how this workload's result differs from the native path on the same inputs.
        Bad input the repetition met on a CUDA device raises here (the device error record, rlkernel.errors)."""
        mismatch = self.compare(inputs) if self.compare else None
        errors.check_errors()  # the comparison has synchronised: reading the record costs one small copy
        return mismatch

    def bytes_moved(self, shape: Shape, dtype: torch.dtype) -> int:
        return int(self.count_bytes(self.effective_shape(shape), dtype))

    def flops(self, shape: Shape, dtype: torch.dtype) -> int:
        return int(self.count_flops(self.effective_shape(shape), dtype))

    def manifest_entry(self, shape: Shape, dtype: torch.dtype, warmup: int, repeat: int) -> dict:
        return {"name": self.name, "op": self.op, "path": self.path, "shape": self.effective_shape(shape).as_dict(),
                "dtype": str(dtype).removeprefix("torch."), "warmup": warmup, "repeat": repeat,
                "bytes": self.bytes_moved(shape, dtype), "flops": self.flops(shape, dtype),
                "fused_patterns": list(self.fused_patterns), "fused_ops": list(self.fused_ops)}


REGISTRY: dict[str, Workload] = {}


def register(workload: Workload) -> Workload:
    if workload.name in REGISTRY:
        raise ValueError(f"workload {workload.name!r} registered twice")
    REGISTRY[workload.name] = workload
    return workload


def names() -> list[str]:
    return list(REGISTRY)


def get(name: str) -> Workload:
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown workload {name!r}; known: {', '.join(REGISTRY)}") from None


def fused_available(workload: Workload, device, dtype: torch.dtype) -> str | None:
    """None when every op of ``workload.fused_ops`` can run fused here, else the first reason it cannot."""
    for op in workload.fused_ops:
        reason = dispatch.fused_unavailable_reason(op, torch.device(device), dtype)
        if reason:
            return reason
    return None


# ---- inputs -------------------------------------------------------------------------------------------

def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _logits(shape: Shape, dtype, device, seed) -> torch.Tensor:
    # Random logits with a spread like a language model's (never zeros: zeros hide unwritten outputs).
    g = _generator(device, seed)
    return (torch.randn(shape.rows, shape.vocab_size, generator=g, device=device, dtype=torch.float32) * 2.0).to(dtype)


def _logp_inputs(shape, dtype, device, seed, *, backward=False):
    g = _generator(device, seed + 1)
    logits = _logits(shape, dtype, device, seed)
    ids = torch.randint(0, shape.vocab_size, (shape.rows,), generator=g, device=device)
    inputs = {"logits": logits, "ids": ids, "temperature": shape.temperature}
    if backward:
        logits.requires_grad_(True)
        inputs["grad"] = torch.randn(shape.rows, generator=g, device=device, dtype=torch.float32)
    return inputs


def _sample_inputs(shape, dtype, device, seed):
    inputs = {"logits": _logits(shape, dtype, device, seed), "temperature": shape.temperature, "top_k": shape.top_k,
              "top_p": shape.top_p, "min_p": shape.min_p, "generator": _generator(device, seed + 2), "seed": None,
              "offset": 0}
    if shape.per_row:  # the same values, as per-row tensors, each row with its own seed (a rollout engine's call)
        n = shape.rows
        inputs.update(temperature=torch.full((n,), shape.temperature, device=device),
                      top_k=torch.full((n,), shape.top_k, dtype=torch.int64, device=device),
                      top_p=torch.full((n,), shape.top_p, device=device),
                      min_p=torch.full((n,), shape.min_p, device=device), generator=None,
                      seed=torch.arange(n, dtype=torch.int64, device=device) * 1_000_003 + seed,
                      offset=torch.zeros(n, dtype=torch.int64, device=device))
    return inputs


# the mixed workload's per-row settings, cycled over the rows: the issue-20 grid (T, k, top_p, min_p; k = -1: V)
_MIXED = [(t, k, p, m) for t in (0.0, 0.7, 1.0) for k in (0, 1, 50, -1) for p in (0.3, 0.9, 1.0)
          for m in (0.0, 0.05, 0.3)]


def _mixed_inputs(shape, dtype, device, seed):
    """Rows with mixed per-row settings (the shape's filters are not used) and per-row seeds and offsets."""
    n, v = shape.rows, shape.vocab_size
    cfg = [_MIXED[r % len(_MIXED)] for r in range(n)]
    t, k, p, m = (list(c) for c in zip(*cfg, strict=True)) if n else ([], [], [], [])
    k = [v if kk < 0 else kk for kk in k]
    f32 = dict(dtype=torch.float32, device=device)
    return {"logits": _logits(shape, dtype, device, seed), "temperature": torch.tensor(t, **f32),
            "top_k": torch.tensor(k, dtype=torch.int64, device=device), "top_p": torch.tensor(p, **f32),
            "min_p": torch.tensor(m, **f32), "generator": None,
            "seed": torch.arange(n, dtype=torch.int64, device=device) * 7919 + seed,
            "offset": torch.arange(n, dtype=torch.int64, device=device) % 97}


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


def _sample_step(backend):
    def step(inp):
        from rlkernel import sample

        return sample(inp["logits"], temperature=inp["temperature"], top_k=inp["top_k"], top_p=inp["top_p"],
                      min_p=inp["min_p"], generator=inp["generator"], seed=inp["seed"], offset=inp["offset"],
                      backend=backend)
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


def _compare_sample(inp) -> str | None:
    """The fused sampler need not draw the same ids as native; each drawn id must be in the kept set."""
    from rlkernel import sample
    from rlkernel.ops.filters_native import Filtered

    ids = sample(inp["logits"], temperature=inp["temperature"], top_k=inp["top_k"], top_p=inp["top_p"],
                 min_p=inp["min_p"], generator=inp["generator"], seed=inp["seed"], offset=inp["offset"],
                 backend="auto")
    if not isinstance(inp["temperature"], torch.Tensor) and inp["temperature"] == 0:  # greedy: the first maximal id
        want = torch.argmax(inp["logits"], dim=-1)
        if not torch.equal(ids, want):
            row = int((ids != want).nonzero()[0])
            return f"sample: row {row} drew id {int(ids[row])} at temperature 0, argmax is {int(want[row])}"
        return None
    rows = inp["logits"].reshape(-1, inp["logits"].shape[-1])
    kept = Filtered(rows, inp["temperature"], inp["top_k"], inp["top_p"], inp["min_p"]).kept
    outside = ~kept.gather(-1, ids.reshape(-1, 1)).view(ids.shape)
    if bool(outside.any()):
        row = int(outside.nonzero()[0])
        return f"sample: row {row} drew id {int(ids[row])}, outside the top-k/top-p/min-p set"
    return None


def _mismatch(what, got, ref, atol, rtol) -> str | None:
    if got.shape != ref.shape:
        return f"{what}: shape {tuple(got.shape)} != native {tuple(ref.shape)}"
    if torch.allclose(got.float(), ref.float(), atol=atol, rtol=rtol, equal_nan=True):
        return None
    err = (got.float() - ref.float()).abs().nan_to_num(float("inf"))
    i = int(err.flatten().argmax())
    return (f"{what}: max |fused - native| {float(err.flatten()[i]):.3g} at {i} "
            f"(atol {atol:g}, rtol {rtol:g})")


# ---- bytes and flops ----------------------------------------------------------------------------------

def _size(dtype) -> int:
    return dtype.itemsize


def _logp_bytes(s: Shape, dtype) -> int:
    return s.rows * s.vocab_size * _size(dtype) + s.rows * (8 + 4)  # logits once, ids in, logp out


def _logp_bwd_bytes(s: Shape, dtype) -> int:
    # forward reads the logits; backward reads them again and writes the gradient
    return 3 * s.rows * s.vocab_size * _size(dtype) + s.rows * (8 + 4 + 4 + 4)


def _sample_bytes(s: Shape, dtype) -> int:
    return s.rows * s.vocab_size * _size(dtype) + s.rows * 8


def _logp_flops(s: Shape, dtype) -> int:
    return 5 * s.rows * s.vocab_size  # scale, max, subtract, exp, add per logit (exp counted as one)


def _logp_bwd_flops(s: Shape, dtype) -> int:
    return 5 * s.rows * s.vocab_size + 5 * s.rows * s.vocab_size  # forward, then scale/exp/subtract/mul per logit


def _sample_flops(s: Shape, dtype) -> int:
    return 5 * s.rows * s.vocab_size  # the softmax pass; selection among survivors is negligible


def _register_defaults() -> None:
    for path, backend in (("native", "native"), ("fused", "auto")):
        fused = path == "fused"
        register(Workload(
            name=f"logp-{path}", op="logp", path=path, backend=backend,
            fused_ops=("logp.forward",) if fused else (),
            description=f"per-token log-probs, forward only, {path} path",
            build=_logp_inputs, step=_logp_step(backend), count_bytes=_logp_bytes, count_flops=_logp_flops,
            compare=_compare_logp if fused else None))
        register(Workload(
            name=f"logp-{path}-bwd", op="logp+backward", path=path, backend=backend,
            fused_ops=("logp.forward", "logp.backward") if fused else (),
            description=f"per-token log-probs, forward and backward, {path} path",
            build=lambda s, d, dev, seed: _logp_inputs(s, d, dev, seed, backward=True),
            step=_logp_bwd_step(backend), count_bytes=_logp_bwd_bytes, count_flops=_logp_bwd_flops,
            compare=_compare_logp_bwd if fused else None, has_backward=True))
        register(Workload(
            name=f"sampling-{path}", op="sample", path=path, backend=backend,
            fused_ops=("sample",) if fused else (),
            description=f"top-k/top-p/temperature sampling, one token per row, {path} path",
            build=_sample_inputs, step=_sample_step(backend), count_bytes=_sample_bytes, count_flops=_sample_flops,
            compare=_compare_sample if fused else None, uses_seq_len=False))
        register(Workload(
            name=f"sampling-mixed-{path}", op="sample", path=path, backend=backend,
            fused_ops=("sample",) if fused else (),
            description=f"sampling with mixed per-row settings (T, top_k, top_p, min_p cycled over the issue-20 grid) "
                        f"and per-row seeds in one call, {path} path",
            build=_mixed_inputs, step=_sample_step(backend), count_bytes=_sample_bytes, count_flops=_sample_flops,
            compare=_compare_sample if fused else None, uses_seq_len=False))


_register_defaults()


# ---- linear-logp-*: log-probs and entropy from hidden states and the LM head (rlkernel.linear_logp) -----------
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


for _path, _backend in (("native", "native"), ("fused", "auto")):
    register(Workload(
        name=f"linear-logp-{_path}", op="linear_logp", path=_path, backend=_backend,
        fused_ops=("linear_logp.forward",) if _path == "fused" else (),
        description=f"log-probs + entropy from hidden states and the LM head (rlkernel.linear_logp), forward, "
                    f"{_path} path",
        build=_linear_inputs, step=_linear_step(_backend), count_bytes=_linear_bytes, count_flops=_linear_flops,
        compare=_compare_linear if _path == "fused" else None, check_shape=_linear_shape_error))
register(Workload(
    name="linear-logp-fused-bwd", op="linear_logp+backward", path="fused", backend="auto",
    fused_ops=("linear_logp.forward", "linear_logp.backward"),
    description="log-probs + entropy from hidden states and the LM head, forward and backward (hidden, weight)",
    build=lambda s, d, dev, seed: _linear_inputs(s, d, dev, seed, backward=True), step=_linear_bwd_step("auto"),
    count_bytes=_linear_bwd_bytes, count_flops=_linear_bwd_flops, compare=_compare_linear_bwd, has_backward=True,
    check_shape=_linear_shape_error))


# ---- grpo-step: one full GRPO training step (rlkernel.grpo), the example's own code --------------------
# Shape mapping: batch_size = sequences (prompts x samples per prompt), seq_len = completion length,
# vocab_size = the policy's vocabulary. Fixed: prompt_len 4 (the prompt only conditions the rollout) and
# hidden_dim 64 (small, so the vocabulary-sized logits, which rlkernel owns, dominate the step).
_GRPO_PROMPT_LEN, _GRPO_HIDDEN = 4, 64


def _grpo_shape_error(s: Shape) -> str | None:
    # a group of one sample has zero advantage: the traced step would have no policy gradient
    if s.batch_size % 2:
        return f"grpo-step needs an even batch size (groups of >= 2 samples per prompt), got {s.batch_size}"
    return None


def _grpo_config(s: Shape, dtype, seed: int):
    import math

    from rlkernel.grpo import GRPOConfig

    error = _grpo_shape_error(s)
    if error:
        raise ValueError(error)
    group = math.gcd(s.batch_size, 4)  # 4 samples per prompt when batch_size allows, else 2
    return GRPOConfig(num_prompts=s.batch_size // group, samples_per_prompt=group, prompt_len=_GRPO_PROMPT_LEN,
                      completion_len=s.seq_len, vocab_size=s.vocab_size, hidden_dim=_GRPO_HIDDEN,
                      temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=seed, dtype=dtype)


def _grpo_inputs(s: Shape, dtype, device, seed):
    from rlkernel.grpo import Trainer

    cfg = _grpo_config(s, dtype, seed)
    return {"cfg": cfg, "device": device, "trainer": Trainer(cfg, device, logp_backend="auto")}


def _grpo_step(inp):
    return inp["trainer"].step()  # rollout (rlkernel.sample), forward, backward (rlkernel.logp), AdamW step


def _compare_grpo(inp) -> str | None:
    """One step from the same seed with auto and with native logp: the losses must agree within step_bound."""
    from rlkernel.grpo import compare_backends

    c = next(compare_backends(inp["cfg"], inp["device"], 1, logp_backend="auto"))
    if c.diff <= c.bound:
        return None
    return f"grpo-step: |loss(auto) - loss(native)| {c.diff:.3g} > bound {c.bound:.3g} (rlkernel.grpo.step_bound)"


def _grpo_bytes(s: Shape, dtype) -> int:
    # The vocabulary-sized tensors of one step, R = batch * completion rows of V logits in the logits' dtype:
    # rollout head writes + sampler reads + the rollout's raw logp reads (3), policy head writes per position +
    # stack copy (read, write) + logp forward reads (4), reference head writes + logp reads (2), logp backward
    # reads logits, writes their gradient, the head's backward reads it (3): 12 passes (rollout_logprobs "raw",
    # the default; "processed" adds a second policy logp). Plus the float32 head weight (V x H): read
    # by C rollout GEMMs, 2 forwards and the backward, its gradient written, AdamW reads p, g, m, v and writes
    # p, m, v; the embedding (V x H) gets a dense gradient and the same AdamW traffic. O(R*H) terms are left out.
    R, V, H = s.rows, s.vocab_size, _GRPO_HIDDEN
    weight = V * H * 4
    return 12 * R * V * _size(dtype) + weight * (s.seq_len + 3 + 1 + 7) + weight * (1 + 7)


def _grpo_flops(s: Shape, dtype) -> int:
    # head GEMMs 2*R*H*V each: rollout, policy and reference forwards, two backward GEMMs (5); the softmax
    # passes at 5 flops per logit: sampler, its log-prob, the rollout's raw logp, policy and reference logp
    # forwards, logp backward (6).
    R, V, H = s.rows, s.vocab_size, _GRPO_HIDDEN
    return 5 * 2 * R * H * V + 6 * 5 * R * V


register(Workload(
    name="grpo-step", op="grpo-step", path="fused", backend="auto",
    fused_ops=("sample", "logp.forward", "logp.backward"),
    description="one full GRPO step (rlkernel.grpo): rollout with rlkernel.sample, logp forward and backward, "
                "AdamW; batch = sequences, seq_len = completion length",
    build=_grpo_inputs, step=_grpo_step, count_bytes=_grpo_bytes, count_flops=_grpo_flops,
    compare=_compare_grpo, has_backward=True, check_shape=_grpo_shape_error))
