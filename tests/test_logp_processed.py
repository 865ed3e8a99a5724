"""rlkernel.logp with filters (processed log-probs): values and filtered entropy against a float64 reference
(ids outside the kept set included), the gradient with the kept set held fixed, sampler-vs-logp bitwise
equality, and bad values. The same tests run the native path on CPU (and CUDA) and the fused path on CUDA."""
import pytest
import torch
from filter_cases import BACKENDS, all_configs, as_row_tensors, need, row
from raw_logprobs import assert_raw_logprobs
from reference_filtered import processed_grad_ref, processed_ref

import rlkernel
from rlkernel.ops.native.logp_processed import logp_processed_native
from rlkernel.validate import RowSettings

VOCAB = 113
TOLERANCES = [pytest.param(torch.float32, 2e-5, 2e-5, id="float32"),
              pytest.param(torch.bfloat16, 2e-5, 2e-5, id="bfloat16"),
              pytest.param(torch.float64, 1e-6, 1e-6, id="float64")]  # the output is float32


def _f32(v):
    return float(torch.tensor(v, dtype=torch.float32))


def _case(seed, neginf=True):
    """Rows [108, VOCAB] (one per grid config), their settings (float32-rounded, as the op sees them), and ids:
    even rows a kept id (the row's argmax), odd rows a random id (mostly outside the kept set)."""
    configs = [(_f32(t), k, _f32(p), _f32(m)) for t, k, p, m in all_configs(VOCAB)]
    kinds = ("randn", "ties", "neginf") if neginf else ("randn", "ties")
    logits = torch.stack([row(kinds[i % len(kinds)], VOCAB, seed * 1000 + i) for i in range(len(configs))])
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (len(configs),), generator=g)
    ids[::2] = logits.argmax(-1)[::2]
    return logits, configs, ids


def _skip_f64_fused(backend, dtype):
    if backend == "fused" and dtype == torch.float64:
        pytest.skip("the fused path takes 16/32-bit logits (float64 records a fallback)")


@pytest.mark.parametrize("device,backend", BACKENDS)
@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES)
@pytest.mark.parametrize("layout", ["rows", "strided3d"])
def test_processed_logp_and_entropy_match_float64(device, backend, dtype, atol, rtol, layout):
    need(device, backend)
    _skip_f64_fused(backend, dtype)
    logits, configs, ids = _case(3)
    logits = logits.to(dtype)
    ref_lp, ref_ent, margins = processed_ref(logits, ids, configs)
    t, k, p, m = as_row_tensors(configs, device)
    x, i = logits.to(device), ids.to(device)
    if layout == "strided3d":  # [12, 9, V] seen through a transpose: not contiguous in its leading dims
        x = x.view(9, 12, VOCAB).transpose(0, 1)
        i = i.view(9, 12).t()
        t, k, p, m = (v.view(9, 12).t() for v in (t, k, p, m))
    lp, ent = rlkernel.logp(x, i, temperature=t, top_k=k, top_p=p, min_p=m, return_entropy=True, backend=backend)
    if layout == "strided3d":
        lp, ent = lp.t().reshape(-1), ent.t().reshape(-1)
    lp, ent = lp.cpu().double(), ent.cpu().double()
    clear = torch.tensor([mg > 1e-5 for mg in margins])
    assert clear.float().mean() > 0.9
    assert torch.equal(torch.isinf(lp)[clear], torch.isinf(ref_lp)[clear]), "kept set differs from the reference"
    assert (ref_lp[clear] == float("-inf")).sum() > 10  # ids outside the kept set are exercised
    fin = clear & torch.isfinite(ref_lp)
    torch.testing.assert_close(lp[fin], ref_lp[fin], atol=atol, rtol=rtol)
    torch.testing.assert_close(ent[clear], ref_ent[clear], atol=atol * 10, rtol=rtol * 10)


@pytest.mark.parametrize("device,backend", BACKENDS)
def test_scalar_filters_match_float64(device, backend):
    need(device, backend)
    logits, _, ids = _case(5)
    for t, k, p, m in [(0.7, 20, 0.9, 0.0), (1.0, 0, 0.5, 0.05), (1.3, 3, 1.0, 0.0), (0.0, 0, 1.0, 0.0),
                       (1.0, 0, 1.0, 0.3)]:
        cfg = [(_f32(t), k, _f32(p), _f32(m))] * logits.shape[0]
        ref_lp, _, margins = processed_ref(logits, ids, cfg)
        lp = rlkernel.logp(logits.to(device), ids.to(device), temperature=t, top_k=k, top_p=p, min_p=m,
                           backend=backend).cpu().double()
        clear = torch.tensor([mg > 1e-5 for mg in margins])
        assert torch.equal(torch.isinf(lp)[clear], torch.isinf(ref_lp)[clear])
        fin = clear & torch.isfinite(ref_lp)
        torch.testing.assert_close(lp[fin], ref_lp[fin], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("device,backend", BACKENDS)
@pytest.mark.parametrize("dtype,atol,rtol", [TOLERANCES[0], TOLERANCES[2]])
def test_gradient_holds_the_kept_set_fixed(device, backend, dtype, atol, rtol):
    need(device, backend)
    _skip_f64_fused(backend, dtype)
    logits, configs, ids = _case(7, neginf=False)
    g = torch.Generator().manual_seed(8)
    g_lp, g_ent = torch.randn(len(configs), generator=g), torch.randn(len(configs), generator=g)
    ref = processed_grad_ref(logits.to(dtype), ids, configs, g_lp, g_ent)
    _, _, margins = processed_ref(logits.to(dtype), ids, configs)
    x = logits.to(dtype).to(device).requires_grad_(True)
    t, k, p, m = as_row_tensors(configs, device)
    lp, ent = rlkernel.logp(x, ids.to(device), temperature=t, top_k=k, top_p=p, min_p=m, return_entropy=True,
                            backend=backend)
    # a row whose id is not kept has logp -inf: its weight is 0 here, and its gradient must not be NaN
    w = torch.where(torch.isinf(lp), torch.zeros_like(lp), lp)
    ((g_lp.to(device) * w).sum() + (g_ent.to(device) * ent).sum()).backward()
    clear = torch.tensor([mg > 1e-5 for mg in margins])
    torch.testing.assert_close(x.grad.cpu().double()[clear], ref[clear], atol=atol * 10, rtol=rtol * 10)


def test_gradcheck_native_float64():
    logits, configs, ids = _case(9, neginf=False)
    sel = [1, 30, 41, 60, 77, 100]  # a mix of T, k, p, min_p (T = 0 rows included: constant)
    logits, ids = logits[sel].double().requires_grad_(True), ids[sel]
    settings = RowSettings(*as_row_tensors([configs[s] for s in sel], "cpu"))

    def f(x):
        lp, ent = logp_processed_native(x, ids, settings=settings, ignore_index=-100, return_entropy=True,
                                        keep_dtype=True)
        return torch.where(torch.isinf(lp), torch.zeros_like(lp), lp), ent

    assert torch.autograd.gradcheck(f, (logits,), eps=1e-7, atol=1e-6)


@pytest.mark.parametrize("device,backend", BACKENDS)
@pytest.mark.parametrize("per_row", [True, False])
def test_sampler_logprobs_equal_logp_bitwise(device, backend, per_row):
    need(device, backend)
    logits, configs, _ = _case(11)
    logits = logits.to(device)
    if per_row:
        t, k, p, m = as_row_tensors(configs, device)
        kw = dict(temperature=t, top_k=k, top_p=p, min_p=m)
        raw_t = torch.where(t > 0, t, torch.ones_like(t))
    else:
        kw = dict(temperature=0.8, top_k=30, top_p=0.9, min_p=0.05)
        raw_t = 0.8
    seed = torch.arange(logits.shape[0], device=device)
    ids, lp = rlkernel.sample(logits, seed=seed, return_logprobs="processed", backend=backend, **kw)
    assert torch.equal(lp, rlkernel.logp(logits, ids, backend=backend, **kw))
    assert torch.isfinite(lp).all()  # a drawn id is always kept
    ids2, raw = rlkernel.sample(logits, seed=seed, return_logprobs=True, backend=backend, **kw)
    assert torch.equal(ids2, ids)
    if backend == "fused":  # the sampler's own pass: within the contract's bound (docs/contracts.md, section 1)
        assert_raw_logprobs(raw, logits, ids, kw["temperature"])
    else:
        assert torch.equal(raw, rlkernel.logp(logits, ids, temperature=raw_t, backend=backend))
    assert torch.all(raw <= lp + 1e-6)  # log p_i <= log p_i - log S


def test_bad_values_raise_naming_the_argument():
    logits = torch.randn(2, 3, 10)
    ids = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="top_p"):
        rlkernel.logp(logits, ids, top_p=torch.full((3,), 0.5))
    for bad in (-0.5, 2.0):
        with pytest.raises(ValueError, match="min_p"):
            rlkernel.logp(logits, ids, min_p=bad)
    m = torch.zeros(2, 3)
    m[0, 1] = float("nan")
    with pytest.raises(ValueError, match="min_p of row 1"):
        rlkernel.logp(logits, ids, min_p=m)
    with pytest.raises(ValueError, match="top_k"):
        rlkernel.logp(logits, ids, top_k=-2)
    with pytest.raises(ValueError, match="temperature"):
        rlkernel.logp(logits, ids, temperature=torch.tensor(-1.0))


@pytest.mark.parametrize("device,backend", BACKENDS[1:])
def test_bad_cuda_row_values_go_to_the_device_record(device, backend):
    need(device, backend)
    logits = torch.randn(4, 50, device=device)
    ids = torch.tensor([1, 2, 3, -100], device=device)
    min_p = torch.tensor([0.0, -1.0, 0.1, 0.0], device=device)
    lp = rlkernel.logp(logits, ids, min_p=min_p, backend=backend)
    assert torch.isnan(lp[1]) and not torch.isnan(lp[[0, 2, 3]]).any()
    with pytest.raises(ValueError, match="min_p of row 1"):
        rlkernel.check_errors(device)
