"""Helpers the families share: seeded generators and logits, the one-line mismatch, an element's size.

Private to the ``rlkernel.workloads`` package (hence the underscores): callers use the registry, not these.
"""
from __future__ import annotations

import torch

from rlkernel.workloads.registry import Shape


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _logits(shape: Shape, dtype, device, seed) -> torch.Tensor:
    # Random logits with a spread like a language model's (never zeros: zeros hide unwritten outputs).
    g = _generator(device, seed)
    return (torch.randn(shape.rows, shape.vocab_size, generator=g, device=device, dtype=torch.float32) * 2.0).to(dtype)


def _mismatch(what, got, ref, atol, rtol) -> str | None:
    if got.shape != ref.shape:
        return f"{what}: shape {tuple(got.shape)} != native {tuple(ref.shape)}"
    if torch.allclose(got.float(), ref.float(), atol=atol, rtol=rtol, equal_nan=True):
        return None
    err = (got.float() - ref.float()).abs().nan_to_num(float("inf"))
    i = int(err.flatten().argmax())
    return (f"{what}: max |fused - native| {float(err.flatten()[i]):.3g} at {i} "
            f"(atol {atol:g}, rtol {rtol:g})")


def _size(dtype) -> int:
    return dtype.itemsize
