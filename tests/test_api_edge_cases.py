"""Defects a red-team pass over the public API found on CPU (2026-12-05), each pinned: a filtered
linear_logp_loss checks what loss_fn returns and keeps float64; float64 top_p / min_p tensors are judged as given;
check_errors names no CUDA device where CUDA is absent; batch_invariant=True on CPU holds for odd widths (MKL's
result for a row depends on the row's address alignment)."""
from __future__ import annotations

import warnings

import pytest
import torch

import rlkernel


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rlkernel.FallbackWarning)
        yield


def _head(dtype=torch.float32, n=4, h=8, v=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, h, generator=g, dtype=dtype), torch.randn(v, h, generator=g, dtype=dtype),
            torch.tensor([0, 1, 5, -100][:n]))


@pytest.mark.parametrize("bad", [lambda lp, e, s: (-lp).sum(), lambda lp, e, s: (-lp)[:, None],
                                 lambda lp, e, s: [0.0] * lp.numel()])
def test_filtered_loss_checks_the_loss_fn_output_as_the_plain_loss_does(bad):
    """A scalar once broadcast into a loss scaled by the token count, silently; a [c, 1] likewise."""
    hidden, weight, ids = _head()
    for filters in ({}, {"top_k": 3}):
        with pytest.raises(ValueError, match="loss_fn must return the chunk's per-token losses, shape"):
            rlkernel.linear_logp_loss(hidden, weight, ids, bad, **filters)


def test_filtered_loss_of_float64_inputs_is_float64():
    hidden, weight, _ = _head(torch.float64)
    ids = torch.tensor([0, 1, 5, 2])
    seen = []

    def loss_fn(lp, ent, sl):
        seen.append((lp.dtype, ent.dtype))
        return -lp

    x = hidden.clone().requires_grad_()
    loss = rlkernel.linear_logp_loss(x, weight, ids, loss_fn, top_k=4)
    loss.backward()
    assert loss.dtype == torch.float64 and seen == [(torch.float64, torch.float64)] and x.grad.dtype == torch.float64
    lp = rlkernel.linear_logp(hidden, weight, ids, top_k=4)
    # against the filtered linear_logp (float32 there): the same log-probs up to its float32 rounding
    torch.testing.assert_close(loss, -lp.double().sum(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name,values,message", [
    ("top_p", [0.5, 1e-50, 1.0], r"top_p of row 1 is out of range \(1e-50\): must be in \(0, 1\]; it rounds to 0"),
    ("min_p", [0.0, 1 + 1e-10, 0.5], r"min_p of row 1 is out of range \(1.0000000001\): must be in \[0, 1\]$"),
    ("top_p", [0.5, 1.5, 1.0], r"top_p of row 1 is out of range \(1.5\): must be in \(0, 1\]$"),
])
def test_float64_probability_tensors_are_judged_as_given(name, values, message):
    """As the same Python number: 1 + 1e-10 is out of range although float32 rounds it to 1; 1e-50 is in range as
    given but rounds to 0, which the message says."""
    logits, ids = torch.randn(3, 10), torch.tensor([0, 1, 2])
    setting = {name: torch.tensor(values, dtype=torch.float64)}
    for call in (lambda: rlkernel.logp(logits, ids, **setting), lambda: rlkernel.sample(logits, **setting),
                 lambda: rlkernel.linear_logp(torch.randn(3, 4), torch.randn(10, 4), ids, **setting)):
        with pytest.raises(ValueError, match=message):
            call()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA case")
@pytest.mark.parametrize("device", ["cuda", torch.device("cuda:0"), 0, None, "cpu"])
def test_check_errors_is_a_no_op_where_cuda_is_absent(device):
    assert rlkernel.check_errors(device) is None


@pytest.mark.parametrize("h,v,dtype", [(33, 5, torch.float32), (1001, 37, torch.float64), (57, 129, torch.float32)])
def test_cpu_batch_invariance_holds_for_odd_widths(h, v, dtype):
    """A row's logits, log-prob and hidden gradient alone equal its values among 150 rows (plain and processed)."""
    g = torch.Generator().manual_seed(h + v)
    hidden, weight = torch.randn(150, h, generator=g, dtype=dtype), torch.randn(v, h, generator=g, dtype=dtype)
    ids = torch.randint(0, v, (150,), generator=g)
    full = rlkernel.linear_logits(hidden, weight)
    for filters in ({}, {"top_k": 3}):
        x = hidden.clone().requires_grad_()
        lp = rlkernel.linear_logp(x, weight, ids, batch_invariant=True, **filters)
        torch.where(torch.isinf(lp), 0, lp).sum().backward()
        for r in (0, 1, 2, 3, 77, 128, 149):
            assert torch.equal(rlkernel.linear_logits(hidden[r:r + 1], weight)[0], full[r]), r
            one = hidden[r:r + 1].clone().requires_grad_()
            l1 = rlkernel.linear_logp(one, weight, ids[r:r + 1], batch_invariant=True, **filters)
            torch.where(torch.isinf(l1), 0, l1).sum().backward()
            assert torch.equal(l1, lp[r:r + 1].detach()) and torch.equal(one.grad, x.grad[r:r + 1]), (filters, r)


@pytest.mark.parametrize("h", [33, 57])
def test_cpu_batch_invariance_with_float32_logits_of_16bit_inputs(h):
    """logits_dtype=torch.float32 of bf16 inputs: the float32 copy of the block is aligned too."""
    g = torch.Generator().manual_seed(h)
    hidden, weight = torch.randn(150, h, generator=g).bfloat16(), torch.randn(5, h, generator=g).bfloat16()
    ids = torch.randint(0, 5, (150,), generator=g)
    kw = dict(batch_invariant=True, logits_dtype=torch.float32)
    full = rlkernel.linear_logits(hidden, weight, **kw)
    lp = rlkernel.linear_logp(hidden, weight, ids, **kw)
    for r in (0, 1, 2, 3, 77, 149):
        assert torch.equal(rlkernel.linear_logits(hidden[r:r + 1], weight, **kw)[0], full[r]), r
        assert torch.equal(rlkernel.linear_logp(hidden[r:r + 1], weight, ids[r:r + 1], **kw), lp[r:r + 1]), r


def test_float64_temperature_tensors_are_judged_as_given():
    """-1e-50 rounds to -0.0 in float32, which would pass as a silent greedy row: refused, as the number is."""
    logits = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"temperature of row 1 is out of range \(-1e-50\)"):
        rlkernel.sample(logits, temperature=torch.tensor([1.0, -1e-50], dtype=torch.float64))
