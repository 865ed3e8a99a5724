"""Shared by the per-row sampler and processed-logp tests: the (device, backend) pairs they run on, and batches of
rows with mixed per-row settings. The fused pair runs on a CUDA machine with the extension built (not a skip there:
a missing build fails)."""
import itertools

import pytest
import torch

TEMPERATURES = (0.0, 0.7, 1.0)
TOP_PS = (0.3, 0.9, 1.0)
MIN_PS = (0.0, 0.05, 0.3)


def top_ks(vocab):
    return (0, 1, 50, vocab)


def all_configs(vocab):
    """Every (T, k, p, min_p) of the issue's grid."""
    return list(itertools.product(TEMPERATURES, top_ks(vocab), TOP_PS, MIN_PS))


def _fused_ready():
    from rlkernel import _ext

    return _ext.unavailable_reason() is None and _ext.has_op("sample")


BACKENDS = [
    pytest.param("cpu", "native", id="cpu-native"),
    pytest.param("cuda", "native", id="cuda-native",
                 marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
    pytest.param("cuda", "fused", id="cuda-fused",
                 marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]


def need(device, backend):
    if backend == "fused":
        assert _fused_ready(), "rlkernel._C is not built (or lacks the sample op): python setup.py build_ext --inplace"


def row(kind, vocab, seed):
    """One row of logits (float32, CPU): random, with ties, or with -inf entries."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(vocab, generator=g) * 2
    if kind == "ties":
        x[3] = x[10] = x[20]
        x[7] = x.max()  # a tie at the top: the lower id wins
    elif kind == "neginf":
        x[torch.randperm(vocab, generator=g)[: vocab // 4]] = float("-inf")
    return x


def as_row_tensors(settings, device, shape=None):
    """Per-row settings [(T, k, p, min_p), ...] as four tensors (of ``shape`` if given) on ``device``."""
    t, k, p, m = zip(*settings, strict=True)
    out = (torch.tensor(t, dtype=torch.float32), torch.tensor(k, dtype=torch.int64),
           torch.tensor(p, dtype=torch.float32), torch.tensor(m, dtype=torch.float32))
    return tuple((v.view(shape) if shape is not None else v).to(device) for v in out)
