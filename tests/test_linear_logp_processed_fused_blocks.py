"""The fused processed linear_logp's host side on the CPU: its row blocks, GEMMs, per-block kernel calls, saved
stats / thresholds, dW / dH / bias-gradient sums and the batch-invariant padding, with the two CUDA kernels
(``logp_processed_forward`` / ``_backward``, an edge a CPU test cannot reach) replaced by fakes built on the
native kept-set code. The fake forward writes each row's settings into its stats, and the fake backward rebuilds
the kept set from the stats it is handed: a block given another block's stats rows would give wrong gradients.
The real kernels run in tests/test_linear_logp_processed.py on CUDA."""
import pytest
import torch
from filter_cases import all_configs, as_row_tensors

import rlkernel
from rlkernel import errors
from rlkernel.ops.fused import linear_logp_processed as fused
from rlkernel.ops.fused import logp_processed
from rlkernel.ops.native.filters import Filtered
from rlkernel.ops.native.logp_processed import processed_grad, processed_values
from rlkernel.validate import RowSettings

VOCAB, HIDDEN = 97, 16


def _settings_of(n, t, k, p, mp, t_rows, k_rows, p_rows, mp_rows):
    def pick(rows, scalar, dtype):
        return rows.to(dtype) if rows is not None else torch.full((n,), scalar, dtype=dtype)

    return RowSettings(pick(t_rows, t, torch.float32), pick(k_rows, k, torch.int64), pick(p_rows, p, torch.float32),
                       pick(mp_rows, mp, torch.float32))


def _fake_forward(x, ids, t, k, p, mp, t_rows, k_rows, p_rows, mp_rows, ignore_index, entropy, *record):
    n = x.shape[0]
    s = _settings_of(n, t, k, p, mp, t_rows, k_rows, p_rows, mp_rows)
    valid = ids != ignore_index
    safe = torch.where(valid, ids, torch.zeros_like(ids))
    out, ent, _ = processed_values(Filtered(x, *s), safe, valid, torch.zeros_like(valid), entropy)
    stats = torch.stack([s.temperature, s.top_k.float(), s.top_p, s.min_p], -1)
    return out.float(), (ent.float() if entropy else torch.empty(0)), stats, torch.arange(n) + 1000


def _fake_backward(gl, ge, x, ids, stats, threshold, ignore_index):
    s = RowSettings(stats[:, 0].contiguous(), stats[:, 1].long(), stats[:, 2].contiguous(), stats[:, 3].contiguous())
    assert torch.equal(threshold, threshold.sort().values)  # the block's own rows, in order
    valid = ids != ignore_index
    safe = torch.where(valid, ids, torch.zeros_like(ids))
    return processed_grad(Filtered(x, *s), safe, valid, torch.zeros_like(valid), gl, ge).to(x.dtype)


class _Ops:
    logp_processed_forward = staticmethod(_fake_forward)
    logp_processed_backward = staticmethod(_fake_backward)


@pytest.fixture
def fake_kernels(monkeypatch):
    monkeypatch.setattr(fused._ext, "load", lambda: None)
    monkeypatch.setattr(logp_processed, "ensure_registered", lambda: None)
    monkeypatch.setattr(fused.errors, "begin", lambda *a, **k: (0, 0, False))
    monkeypatch.setattr(torch.ops, "rlkernel", _Ops, raising=False)
    assert fused.errors is errors


def _inputs(dtype=torch.float32):
    configs = [c for c in all_configs(VOCAB) if c[0] > 0][:50]
    g = torch.Generator().manual_seed(0)
    n = len(configs)
    hidden = torch.randn(n, HIDDEN, generator=g).to(dtype)
    weight = (torch.randn(VOCAB, HIDDEN, generator=g) * 0.5).to(dtype)
    bias = (torch.randn(VOCAB, generator=g) * 0.3).to(dtype)
    ids = torch.randint(0, VOCAB, (n,), generator=g)
    ids[::2] = (hidden @ weight.T + bias).float().argmax(-1)[::2]
    ids[7] = -100
    return hidden, weight, bias, ids, RowSettings(*as_row_tensors(configs, "cpu"))


@pytest.mark.parametrize("block", [7, 16, 1000])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_blocks_give_the_native_values_and_gradients(fake_kernels, monkeypatch, block, batch_invariant):
    from rlkernel.ops.fused import linear_logp as plain_fused

    monkeypatch.setattr(fused, "_override_rows", block)
    monkeypatch.setattr(plain_fused, "_override", (block, 40) if batch_invariant else None)  # BI blocks and tiles
    hidden, weight, bias, ids, s = _inputs()
    g = torch.Generator().manual_seed(1)
    gl, ge = torch.randn(len(ids), generator=g), torch.randn(len(ids), generator=g)
    results = {}
    for name in ("fused", "native"):
        h, w, b = (x.clone().requires_grad_(True) for x in (hidden, weight, bias))
        if name == "fused":
            lp, ent = fused.linear_logp_processed_fused(h, w, ids, bias=b, settings=s, csr=None, ignore_index=-100,
                                                        return_entropy=True, batch_invariant=batch_invariant)
        else:
            lp, ent = rlkernel.linear_logp(h, w, ids, bias=b, return_entropy=True, backend="native",
                                           batch_invariant=batch_invariant, **s._asdict())
        wt = torch.where(torch.isinf(lp), torch.zeros_like(lp), lp)
        ((gl * wt).sum() + (ge * ent).sum()).backward()
        results[name] = (lp.detach(), ent.detach(), h.grad, w.grad, b.grad)
    assert torch.isinf(results["native"][0]).sum() > 5  # ids off the kept set are exercised
    for a, b_ in zip(results["fused"], results["native"], strict=True):
        torch.testing.assert_close(a, b_, atol=1e-5, rtol=1e-5, equal_nan=True)


def test_no_grad_call_and_csr_blocks(fake_kernels, monkeypatch):
    monkeypatch.setattr(fused, "_override_rows", 9)
    hidden, weight, bias, ids, s = _inputs()
    with torch.no_grad():
        lp, ent = fused.linear_logp_processed_fused(hidden, weight, ids, bias=bias, settings=s, csr=None,
                                                    ignore_index=-100, return_entropy=True)
    ref = rlkernel.linear_logp(hidden, weight, ids, bias=bias, return_entropy=True, backend="native", **s._asdict())
    torch.testing.assert_close(lp, ref[0]) and torch.testing.assert_close(ent, ref[1])
    from rlkernel.ops.native.linear_logp_processed import csr_rows

    kept = [sorted({int(ids[r]) % VOCAB, (r * 7) % VOCAB, 3}) for r in range(len(ids))]
    kid = torch.tensor([i for k in kept for i in k])
    koff = torch.tensor([0] + torch.tensor([len(k) for k in kept]).cumsum(0).tolist())
    s_t = RowSettings(s.temperature, 0, 1.0, 0.0)
    h = hidden.clone().requires_grad_(True)
    lp, ent = fused.linear_logp_processed_fused(h, weight, ids, bias=bias, settings=s_t,
                                                csr=csr_rows(kid, koff, len(ids)), ignore_index=-100,
                                                return_entropy=True)
    (lp.sum() + ent.sum()).backward()
    h2 = hidden.clone().requires_grad_(True)
    ref = rlkernel.linear_logp(h2, weight, ids, bias=bias, temperature=s.temperature, kept_ids=kid,
                               kept_offsets=koff, return_entropy=True, backend="native")
    (ref[0].sum() + ref[1].sum()).backward()
    torch.testing.assert_close(lp, ref[0]) and torch.testing.assert_close(ent, ref[1])
    torch.testing.assert_close(h.grad, h2.grad)
