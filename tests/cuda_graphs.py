"""What the CUDA-graph tests share: PyTorch's documented warm-up before a capture, and the sampler's replays with
device seeds and offsets against eager calls."""
from __future__ import annotations

import torch

import rlkernel


def warm_on_side_stream(fn, times: int = 2) -> None:
    """Run ``fn`` ``times`` times on a side stream (allocator pools and lazy init happen there, not in the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(times):
            fn()
    torch.cuda.current_stream().wait_stream(side)


def sampler_replays_against_eager(x, kw, return_logprobs, rows: int = 256):
    """``rlkernel.sample(x, seed=<device tensor>, offset=<device tensor>, return_logprobs=...)`` captured once, replayed
    at three (offset, seed shift) steps, each against the eager call with the same seeds and offset: asserts the ids
    equal, and that the offset and the seeds reached the kernel; returns [(replay ids, replay log-probs, eager
    log-probs)] for the caller's log-prob checks."""
    seeds = torch.arange(rows, device="cuda") + 1000
    offset = torch.zeros(rows, dtype=torch.int64, device="cuda")

    def call():
        return rlkernel.sample(x, seed=seeds, offset=offset, return_logprobs=return_logprobs, backend="fused", **kw)

    warm_on_side_stream(call)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, lp = call()
    got, steps = [], [(0, 0), (1, 0), (2, 5)]
    for step, shift in steps:
        offset.fill_(step)
        seeds.copy_(torch.arange(rows, device="cuda") + 1000 + shift)
        graph.replay()
        got.append((ids.clone(), lp.clone()))
    out = []
    for (step, shift), (g_ids, g_lp) in zip(steps, got, strict=True):
        s = torch.arange(rows, device="cuda") + 1000 + shift
        want, want_lp = rlkernel.sample(x, seed=s, offset=torch.full_like(offset, step),
                                        return_logprobs=return_logprobs, backend="fused", **kw)
        assert torch.equal(g_ids, want), f"replay at offset {step}, seed shift {shift}: ids differ from eager"
        out.append((g_ids, g_lp, want_lp))
    assert not torch.equal(got[0][0], got[1][0]), "the offset did not reach the kernel"
    assert not torch.equal(got[1][0], got[2][0]), "the seeds did not reach the kernel"
    return out
