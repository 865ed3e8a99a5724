"""The sampling family (``rlkernel.sample``): ``sampling-{native,fused}`` and ``sampling-mixed-{native,fused}``.

The ops (and the native filters the check reads) are imported inside the steps, at call time: importing the
registry imports no op module, and a test that patches ``rlkernel.sample`` reaches the workloads.
"""
from __future__ import annotations

import torch

from rlkernel.workloads.common import _generator, _logits, _size
from rlkernel.workloads.registry import Shape, Workload

# ---- inputs -------------------------------------------------------------------------------------------

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

def _sample_step(backend):
    def step(inp):
        from rlkernel import sample

        return sample(inp["logits"], temperature=inp["temperature"], top_k=inp["top_k"], top_p=inp["top_p"],
                      min_p=inp["min_p"], generator=inp["generator"], seed=inp["seed"], offset=inp["offset"],
                      backend=backend)
    return step


# ---- checks against native on the same inputs ---------------------------------------------------------

def _compare_sample(inp) -> str | None:
    """The fused sampler need not draw the same ids as native; each drawn id must be in the kept set."""
    from rlkernel import sample
    from rlkernel.ops.native.filters import Filtered

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


# ---- bytes and flops ----------------------------------------------------------------------------------

def _sample_bytes(s: Shape, dtype) -> int:
    # one read of the logits, the ids written. A call with return_logprobs (the fused path, "processed" or True)
    # moves 4 bytes more a row, its log-probs: they come out of the same read (docs/contracts.md, section 1; True's
    # candidates path also writes and reads 64 bytes of softmax states per 8192-token chunk, < 0.4 % of a bf16 chunk)
    return s.rows * s.vocab_size * _size(dtype) + s.rows * 8



def _sample_flops(s: Shape, dtype) -> int:
    return 5 * s.rows * s.vocab_size  # the softmax pass; selection among survivors is negligible


def workloads(path: str, backend: str) -> list[Workload]:
    """This family's workloads of one path, in registration order: the shape's settings, then the mixed grid."""
    fused = path == "fused"
    return [
        Workload(
            name=f"sampling-{path}", op="sample", path=path, backend=backend,
            fused_ops=("sample",) if fused else (),
            description=f"top-k/top-p/temperature sampling, one token per row, {path} path",
            build=_sample_inputs, step=_sample_step(backend), count_bytes=_sample_bytes, count_flops=_sample_flops,
            compare=_compare_sample if fused else None, uses_seq_len=False),
        Workload(
            name=f"sampling-mixed-{path}", op="sample", path=path, backend=backend,
            fused_ops=("sample",) if fused else (),
            description=f"sampling with mixed per-row settings (T, top_k, top_p, min_p cycled over the issue-20 grid) "
                        f"and per-row seeds in one call, {path} path",
            build=_mixed_inputs, step=_sample_step(backend), count_bytes=_sample_bytes, count_flops=_sample_flops,
            compare=_compare_sample if fused else None, uses_seq_len=False, own_settings=True),
    ]
