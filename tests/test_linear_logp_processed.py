"""rlkernel.linear_logp in processed mode (top_k / top_p / min_p, per-row settings, a CSR kept set) and
rlkernel.linear_logits: values and filtered entropy against a float64 reference on the logits, gradients of hidden,
weight and bias with the kept set held fixed, batch_invariant=True bitwise rlkernel.logp(linear_logits(...)), and
bad arguments. The same tests run the native path on CPU (and CUDA) and the fused path on CUDA; many chunks / blocks
are forced on these small shapes."""
import pytest
import torch
from filter_cases import BACKENDS, all_configs, as_row_tensors, need
from reference_filtered import processed_grad_ref, processed_ref

import rlkernel
from rlkernel.ops.fused import linear_logp_processed as fused_mod
from rlkernel.ops.linear_logits import logits_rows
from rlkernel.ops.native import linear_logp_processed as native_mod
from rlkernel.ops.native.linear_logp_processed import linear_logp_processed_native
from rlkernel.validate import RowSettings

VOCAB, HIDDEN = 113, 24
NEG_INF = float("-inf")


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
    """Chunks / blocks of 16 rows: the 108-row cases cross several, the last one partial."""
    monkeypatch.setattr(native_mod, "CHUNK_ROWS", 16)
    monkeypatch.setattr(fused_mod, "_override_rows", 16)


def _f32(v):
    return float(torch.tensor(v, dtype=torch.float32))


def _case(seed, dtype=torch.float32, neginf=True, ties=True):
    """hidden [108, H], weight [V, H], bias [V] (-inf on a few tokens when ``neginf``), one row per grid config
    (settings float32-rounded, as the op sees them), ids: even rows the row's argmax (kept), odd rows random (mostly
    outside the kept set). ``ties``: weight rows 10 and 20 equal (a tie in every row), row 7 equal to the row
    of the largest logit of row 0 (a tie at the top there)."""
    configs = [(_f32(t), k, _f32(p), _f32(m)) for t, k, p, m in all_configs(VOCAB)]
    g = torch.Generator().manual_seed(seed)
    n = len(configs)
    hidden = torch.randn(n, HIDDEN, generator=g)
    weight = torch.randn(VOCAB, HIDDEN, generator=g) * 0.4
    bias = torch.randn(VOCAB, generator=g) * 0.5
    if ties:
        weight[20] = weight[10]
        bias[20] = bias[10]
        top = int((hidden[0] @ weight.T + bias).argmax())
        if top != 7:
            weight[7], bias[7] = weight[top], bias[top]
    if neginf:
        bias[torch.randperm(VOCAB, generator=g)[:12]] = NEG_INF
    hidden, weight, bias = hidden.to(dtype), weight.to(dtype), bias.to(dtype)
    logits = rlkernel.linear_logits(hidden, weight, bias, batch_invariant=False)
    ids = torch.randint(0, VOCAB, (n,), generator=g)
    ids[::2] = logits.float().argmax(-1)[::2]
    return hidden, weight, bias, configs, ids


def _op_logits(hidden, weight, bias, device="cpu"):
    """The logits the op computes (on ``device``, by its GEMM calls: 16-row chunks / blocks, see _small_chunks), as
    a CPU tensor: the reference's kept sets are then those of the very logits the op ranks (on CUDA another GEMM
    shape could round a bf16 logit to its neighbour and swap a tie at the top_k boundary)."""
    h, w, b = hidden.to(device), weight.to(device), bias.to(device)
    return torch.cat([rlkernel.linear_logits(h[r0:r0 + 16], w, b, batch_invariant=False)
                      for r0 in range(0, h.shape[0], 16)]).cpu()


def _skip_f64_fused(backend, dtype):
    if backend == "fused" and dtype == torch.float64:
        pytest.skip("the fused path takes 16/32-bit inputs (float64 records a fallback)")


DTYPES = [pytest.param(torch.float32, 2e-5, id="float32"), pytest.param(torch.bfloat16, 2e-5, id="bfloat16"),
          pytest.param(torch.float64, 1e-6, id="float64")]


@pytest.mark.parametrize("device,backend", BACKENDS)
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_per_row_filters_match_float64(device, backend, dtype, tol):
    need(device, backend)
    _skip_f64_fused(backend, dtype)
    hidden, weight, bias, configs, ids = _case(3, dtype)
    logits = _op_logits(hidden, weight, bias, device)
    ref_lp, ref_ent, margins = processed_ref(logits, ids, configs)
    t, k, p, m = as_row_tensors(configs, device)
    lp, ent = rlkernel.linear_logp(hidden.to(device), weight.to(device), ids.to(device), bias=bias.to(device),
                                   temperature=t, top_k=k, top_p=p, min_p=m, return_entropy=True, backend=backend)
    lp, ent = lp.cpu().double(), ent.cpu().double()
    clear = torch.tensor([mg > 1e-4 for mg in margins])  # 1e-4: the op's GEMM may round the logits differently
    assert clear.float().mean() > 0.85
    assert torch.equal(torch.isinf(lp)[clear], torch.isinf(ref_lp)[clear]), "kept set differs from the reference"
    assert (ref_lp[clear] == NEG_INF).sum() > 10 and torch.isfinite(ref_lp[clear]).sum() > 30
    fin = clear & torch.isfinite(ref_lp)
    torch.testing.assert_close(lp[fin], ref_lp[fin], atol=tol, rtol=tol)
    torch.testing.assert_close(ent[clear], ref_ent[clear], atol=tol * 10, rtol=tol * 10)


@pytest.mark.parametrize("device,backend", BACKENDS)
def test_scalar_filters_boundaries_k_beyond_v_tiny_top_p_and_t0(device, backend):
    need(device, backend)
    hidden, weight, bias, _, ids = _case(5, neginf=False)
    logits = _op_logits(hidden, weight, bias, device)
    cases = [(0.7, 20, 0.9, 0.0), (1.0, 0, 0.5, 0.05), (1.3, 3, 1.0, 0.0), (0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.3),
             (1.0, VOCAB + 5, 0.8, 0.0), (1.0, VOCAB, 1.0, 0.0), (0.9, 0, 1e-6, 0.0), (1.0, 1, 1.0, 0.0)]
    for t, k, p, m in cases:
        cfg = [(_f32(t), min(k, VOCAB), _f32(p), _f32(m))] * logits.shape[0]
        ref_lp, ref_ent, margins = processed_ref(logits, ids, cfg)
        lp, ent = rlkernel.linear_logp(hidden.to(device), weight.to(device), ids.to(device), bias=bias.to(device),
                                       temperature=t, top_k=k, top_p=p, min_p=m, return_entropy=True,
                                       backend=backend)
        lp, ent = lp.cpu().double(), ent.cpu().double()
        clear = torch.tensor([mg > 1e-4 for mg in margins])
        assert torch.equal(torch.isinf(lp)[clear], torch.isinf(ref_lp)[clear]), (t, k, p, m)
        fin = clear & torch.isfinite(ref_lp)
        torch.testing.assert_close(lp[fin], ref_lp[fin], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(ent[clear], ref_ent[clear], atol=2e-4, rtol=2e-4)
        if p == 1e-6 or k == 1 or t == 0:  # one token kept: log-prob 0 for it, entropy 0
            assert torch.equal(lp[::2], torch.zeros_like(lp[::2])) and torch.equal(ent, torch.zeros_like(ent))


@pytest.mark.parametrize("device,backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_gradients_hold_the_kept_set_fixed(device, backend, dtype):
    need(device, backend)
    _skip_f64_fused(backend, dtype)
    hidden, weight, bias, configs, ids = _case(7, dtype, neginf=False)
    g = torch.Generator().manual_seed(8)
    g_lp, g_ent = torch.randn(len(configs), generator=g), torch.randn(len(configs), generator=g)
    logits = _op_logits(hidden, weight, bias, device)
    ref_g = processed_grad_ref(logits, ids, configs, g_lp, g_ent)  # d loss / d logits, float64
    _, _, margins = processed_ref(logits, ids, configs)
    clear = torch.tensor([mg > 1e-4 for mg in margins])
    ref_g = ref_g * clear.double().unsqueeze(-1)  # rows near a threshold: left out of the comparison
    h, w, b = (x.to(device).requires_grad_(True) for x in (hidden, weight, bias))
    t, k, p, m = as_row_tensors(configs, device)
    lp, ent = rlkernel.linear_logp(h, w, ids.to(device), bias=b, temperature=t, top_k=k, top_p=p, min_p=m,
                                   return_entropy=True, backend=backend)
    wt = torch.where(torch.isinf(lp), torch.zeros_like(lp), lp)  # a row whose id is not kept: no NaN gradient
    mask = clear.to(device).to(lp.dtype)
    ((g_lp.to(device) * wt * mask).sum() + (g_ent.to(device) * ent * mask).sum()).backward()
    tol = dict(atol=2e-4, rtol=2e-4) if dtype == torch.float32 else dict(atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(h.grad.cpu().double(), ref_g @ weight.double(), **tol)
    torch.testing.assert_close(w.grad.cpu().double(), ref_g.T @ hidden.double(), **tol)
    torch.testing.assert_close(b.grad.cpu().double(), ref_g.sum(0), **tol)


def test_gradcheck_native_float64():
    hidden, weight, bias, configs, ids = _case(9, torch.float64, neginf=False, ties=False)
    sel = [1, 30, 41, 60, 77, 100, 5, 50]  # a mix of T, k, p, min_p (T = 0 rows included: constant)
    t, k, p, m = as_row_tensors([configs[s] for s in sel], "cpu")
    h = hidden[sel].clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)

    settings = RowSettings(t.double().float(), k, p, m)

    def f(h, w):  # the float64 outputs of the native path (the public op returns float32)
        def gemm(rows):
            return logits_rows(rows, w, bias, False, False)

        lp, ent = linear_logp_processed_native(h, w, ids[sel], bias=bias, gemm=gemm, settings=settings, csr=None,
                                               ignore_index=-100, return_entropy=True, keep_dtype=True)
        return torch.where(torch.isinf(lp), torch.zeros_like(lp), lp), ent

    assert torch.autograd.gradcheck(f, (h, w), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("device,backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
@pytest.mark.parametrize("logits_dtype", [None, torch.float32], ids=["default", "float32-logits"])
def test_batch_invariant_is_bitwise_logp_of_linear_logits(device, backend, dtype, logits_dtype):
    need(device, backend)
    hidden, weight, bias, configs, ids = _case(11, dtype)
    hidden, weight, bias, ids = hidden.to(device), weight.to(device), bias.to(device), ids.to(device)
    t, k, p, m = as_row_tensors(configs, device)
    filters = dict(temperature=t, top_k=k, top_p=p, min_p=m)
    logits = rlkernel.linear_logits(hidden, weight, bias, logits_dtype=logits_dtype)
    assert logits.dtype == (torch.float32 if logits_dtype else dtype)
    want = rlkernel.logp(logits, ids, return_entropy=True, backend=backend, **filters)
    got = rlkernel.linear_logp(hidden, weight, ids, bias=bias, return_entropy=True, batch_invariant=True,
                               backend=backend, logits_dtype=logits_dtype, **filters)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # a row alone, or among other rows at another position: the same bits (logits and log-probs)
    sel = torch.tensor([5, 70, 3], device=device)
    sub = {key: v[sel] for key, v in filters.items()}
    alone = rlkernel.linear_logp(hidden[sel], weight, ids[sel], bias=bias, return_entropy=True,
                                 batch_invariant=True, backend=backend, logits_dtype=logits_dtype, **sub)
    assert torch.equal(alone[0], got[0][sel]) and torch.equal(alone[1], got[1][sel])
    assert torch.equal(rlkernel.linear_logits(hidden[sel], weight, bias, logits_dtype=logits_dtype), logits[sel])


@pytest.mark.parametrize("device,backend", BACKENDS)
def test_batch_invariant_hidden_gradient_of_a_row_does_not_depend_on_the_batch(device, backend):
    need(device, backend)
    hidden, weight, bias, configs, ids = _case(13)
    t, k, p, m = as_row_tensors(configs, device)

    def grad(sel):
        h = hidden.to(device)[sel].clone().requires_grad_(True)
        lp, ent = rlkernel.linear_logp(h, weight.to(device), ids.to(device)[sel], bias=bias.to(device),
                                       temperature=t[sel], top_k=k[sel], top_p=p[sel], min_p=m[sel],
                                       return_entropy=True, batch_invariant=True, backend=backend)
        (torch.where(torch.isinf(lp), 0.0, lp).sum() + 0.3 * ent.sum()).backward()
        return h.grad

    full = grad(torch.arange(len(configs), device=device))
    sel = torch.tensor([40, 2, 99], device=device)
    assert torch.equal(grad(sel), full[sel])


def _csr(kept_lists, device):
    ids = torch.tensor([i for kept in kept_lists for i in kept], dtype=torch.int64)
    offsets = torch.tensor([0] + list(torch.tensor([len(k) for k in kept_lists]).cumsum(0)), dtype=torch.int64)
    return ids.to(device), offsets.to(device)


def _csr_reference(logits, ids, kept_lists, temperature):
    """float64 (logp, entropy, d logp / d logits + d entropy / d logits summed) under each row's given kept set."""
    x = logits.double().requires_grad_(True)
    lps, ents = [], []
    for r, kept in enumerate(kept_lists):
        z = x[r, kept] / (temperature if temperature > 0 else 1.0)
        logq = z - torch.logsumexp(z, 0)
        i = int(ids[r])
        lps.append(logq[kept.index(i)] if i in kept else x.new_tensor(NEG_INF))
        ents.append(-(logq.exp() * logq).sum())
    lp, ent = torch.stack(lps), torch.stack(ents)
    (grad,) = torch.autograd.grad(torch.where(torch.isinf(lp), 0.0, lp).sum() + ent.sum(), x)
    return lp.detach(), ent.detach(), grad


@pytest.mark.parametrize("device,backend", BACKENDS)
@pytest.mark.parametrize("temperature", [0.8, 1.0])
def test_kept_ids_match_float64_and_equal_the_filters_kept_set(device, backend, temperature):
    need(device, backend)
    hidden, weight, bias, _, ids = _case(17, neginf=False)
    n = hidden.shape[0]
    logits = _op_logits(hidden, weight, bias, device)
    g = torch.Generator().manual_seed(18)
    kept_lists = []
    for r in range(n):  # random kept sets of 1..40 tokens, unsorted, holding the row's id on even rows
        kept = torch.randperm(VOCAB, generator=g)[: 1 + r % 40].tolist()
        if r % 2 == 0 and int(ids[r]) not in kept:
            kept[0] = int(ids[r])
        kept_lists.append(kept)
    kid, koff = _csr(kept_lists, device)
    ref_lp, ref_ent, ref_grad = _csr_reference(logits, ids, kept_lists, temperature)
    h, w, b = (x.to(device).requires_grad_(True) for x in (hidden, weight, bias))
    lp, ent = rlkernel.linear_logp(h, w, ids.to(device), bias=b, temperature=temperature, kept_ids=kid,
                                   kept_offsets=koff, return_entropy=True, backend=backend)
    (torch.where(torch.isinf(lp), 0.0, lp).sum() + ent.sum()).backward()
    assert torch.equal(torch.isinf(lp.cpu()), torch.isinf(ref_lp)) and torch.isinf(ref_lp).sum() > 10
    fin = torch.isfinite(ref_lp)
    torch.testing.assert_close(lp.cpu().double()[fin], ref_lp[fin], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(ent.cpu().double(), ref_ent, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(h.grad.cpu().double(), ref_grad @ weight.double(), atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(w.grad.cpu().double(), ref_grad.T @ hidden.double(), atol=2e-4, rtol=2e-4)
    # the kept set of top_k / top_p given as CSR: the same values as the filters
    filt = dict(temperature=temperature, top_k=30, top_p=0.8)
    from rlkernel.ops.native.filters import Filtered

    f = Filtered(logits, temperature, 30, _f32(0.8), 0.0)
    kid2, koff2 = _csr([row.nonzero().view(-1).tolist() for row in f.kept], device)
    args = (hidden.to(device), weight.to(device), ids.to(device))
    by_csr = rlkernel.linear_logp(*args, bias=bias.to(device), temperature=temperature, kept_ids=kid2,
                                  kept_offsets=koff2, backend=backend)
    by_filters = rlkernel.linear_logp(*args, bias=bias.to(device), backend=backend, **filt)
    assert torch.equal(torch.isinf(by_csr), torch.isinf(by_filters))
    fin = torch.isfinite(by_filters)
    torch.testing.assert_close(by_csr[fin], by_filters[fin], atol=2e-6, rtol=2e-6)


def test_kept_ids_empty_row_is_nan_and_ignored_row_zero():
    hidden, weight, bias, _, ids = _case(19, neginf=False)
    hidden, ids = hidden[:3], ids[:3].clone()
    ids[2] = -100
    kid, koff = _csr([[1, 2], [], [4]], "cpu")
    lp, ent = rlkernel.linear_logp(hidden, weight, ids, bias=bias, kept_ids=kid, kept_offsets=koff,
                                   return_entropy=True, backend="native")
    assert torch.isnan(lp[1]) and torch.isnan(ent[1]) and lp[2] == 0 and ent[2] == 0 and not torch.isnan(lp[0])


def test_bad_arguments_raise_before_any_work():
    hidden, weight, bias, _, ids = _case(21, neginf=False)
    kid, koff = _csr([[1]] * hidden.shape[0], "cpu")
    with pytest.raises(ValueError, match="replace top_k"):
        rlkernel.linear_logp(hidden, weight, ids, kept_ids=kid, kept_offsets=koff, top_k=5)
    with pytest.raises(ValueError, match="replace top_k"):
        rlkernel.linear_logp(hidden, weight, ids, kept_ids=kid, kept_offsets=koff, top_p=torch.ones(len(ids)))
    with pytest.raises(ValueError, match="go together"):
        rlkernel.linear_logp(hidden, weight, ids, kept_ids=kid)
    with pytest.raises(ValueError, match="rows \\+ 1"):
        rlkernel.linear_logp(hidden, weight, ids, kept_ids=kid, kept_offsets=koff[:-1])
    with pytest.raises(ValueError, match="rise from 0"):
        rlkernel.linear_logp(hidden, weight, ids, kept_ids=kid, kept_offsets=koff.flip(0))
    with pytest.raises(ValueError, match="outside"):
        rlkernel.linear_logp(hidden, weight, ids, kept_ids=kid + VOCAB, kept_offsets=koff)
    with pytest.raises(TypeError, match="kept_ids must be an integer"):
        rlkernel.linear_logp(hidden, weight, ids, kept_ids=kid.float(), kept_offsets=koff)
    top_p = torch.full((len(ids),), 0.5)
    top_p[4] = 1.5
    with pytest.raises(ValueError, match="top_p of row 4"):
        rlkernel.linear_logp(hidden, weight, ids, top_p=top_p)
    with pytest.raises(ValueError, match="top_k"):
        rlkernel.linear_logp(hidden, weight, ids, top_k=-1)
    with pytest.raises(ValueError, match="temperature"):
        rlkernel.linear_logp(hidden, weight, ids, temperature=-1.0, top_k=3)
    with pytest.raises(TypeError, match="batch_invariant"):
        rlkernel.linear_logits(hidden, weight, batch_invariant=1)
    with pytest.raises(ValueError, match="weight shape"):
        rlkernel.linear_logits(hidden, weight[:, :3])


def test_linear_logp_loss_with_filters_equals_the_sum_of_processed_logp():
    hidden, weight, bias, configs, ids = _case(23, neginf=False)
    t, k, p, m = as_row_tensors(configs, "cpu")
    ids = ids.clone()
    ids[::2] = ids[::2]  # kept ids on even rows; odd rows mostly outside (log-prob -inf, masked by the loss below)
    adv = torch.randn(len(ids))

    def loss_fn(lp, ent, sl):
        return -torch.where(torch.isinf(lp), 0.0, lp) * adv[sl] - 0.01 * ent

    h1 = hidden.clone().requires_grad_(True)
    loss = rlkernel.linear_logp_loss(h1, weight, ids, loss_fn, bias=bias, temperature=t, top_k=k, top_p=p, min_p=m,
                                     reduction="mean", backend="native")
    loss.backward()
    h2 = hidden.clone().requires_grad_(True)
    lp, ent = rlkernel.linear_logp(h2, weight, ids, bias=bias, temperature=t, top_k=k, top_p=p, min_p=m,
                                   return_entropy=True, backend="native")
    ref = loss_fn(lp, ent, slice(0, len(ids))).sum() / len(ids)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(h1.grad, h2.grad)


def test_plain_arguments_stay_on_the_plain_path():
    hidden, weight, bias, _, ids = _case(25, neginf=False)
    plain = rlkernel.linear_logp(hidden, weight, ids, bias=bias, backend="native")
    from rlkernel.ops import linear_logp_processed as proc

    assert not proc.wants_processed(1.0, 0, 1.0, 0.0, None, None)
    assert proc.wants_processed(0.0, 0, 1.0, 0.0, None, None) and proc.wants_processed(1.0, 5, 1.0, 0.0, None, None)
    same = rlkernel.linear_logp(hidden, weight, ids, bias=bias, backend="native", top_k=0, top_p=1.0, min_p=0.0)
    assert torch.equal(plain, same)


gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("backend", ["fused", "native"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_no_host_sync_and_bad_row_values_go_to_the_device_record(backend):
    need("cuda", backend)
    hidden, weight, bias, configs, ids = _case(27, torch.bfloat16)
    h, w, b, i = (x.cuda() for x in (hidden, weight, bias, ids))
    h.requires_grad_(True)
    t, k, p, m = as_row_tensors(configs, "cuda")
    p = p.clone()
    p[37] = 1.5  # out of range: row 37 (third block of 16 rows) NaN, and the device record naming row 37
    kid, koff = _csr([[1, 2, 3]] * len(ids), "cuda")
    rlkernel.check_errors()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lp, ent = rlkernel.linear_logp(h, w, i, bias=b, temperature=t, top_k=k, top_p=p, min_p=m,
                                       return_entropy=True, backend=backend)
        (torch.where(torch.isinf(lp), 0.0, lp).sum() + ent.sum()).backward()
        lp2 = rlkernel.linear_logp(h.detach(), w, i, bias=b, kept_ids=kid, kept_offsets=koff, backend=backend)
        logits = rlkernel.linear_logits(h.detach(), w, b)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.isnan(lp[37]) and torch.isnan(h.grad[37]).all()
    others = torch.arange(len(ids), device="cuda") != 37
    assert not torch.isnan(lp[others]).any() and torch.isfinite(h.grad[others]).all()
    assert not torch.isnan(lp2).any() and logits.shape == (len(ids), VOCAB)
    with pytest.raises(ValueError, match="top_p of row 37"):
        rlkernel.check_errors()


@pytest.mark.parametrize("backend", ["fused", "native"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_step_equals_eager_bitwise(backend):
    from cuda_graphs import warm_on_side_stream

    need("cuda", backend)
    hidden, weight, bias, configs, ids = _case(29, torch.bfloat16)
    w, b, i = weight.cuda(), bias.cuda(), ids.cuda()
    h = hidden.cuda().requires_grad_(True)
    t, k, p, m = as_row_tensors(configs, "cuda")
    rlkernel.check_errors()

    def step():
        h.grad = None
        lp, ent = rlkernel.linear_logp(h, w, i, bias=b, temperature=t, top_k=k, top_p=p, min_p=m,
                                       return_entropy=True, backend=backend)
        (torch.where(torch.isinf(lp), 0.0, lp).sum() - 0.01 * ent.sum()).backward()
        return lp.detach(), ent.detach(), h.grad

    eager = [x.clone() for x in step()]
    warm_on_side_stream(step)
    graph = torch.cuda.CUDAGraph()
    h.grad = None
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, eager, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("logits_dtype", [None, torch.float32], ids=["default", "float32-logits"])
def test_fused_matches_native_on_cuda(logits_dtype):
    need("cuda", "fused")
    hidden, weight, bias, configs, ids = _case(31, torch.bfloat16)
    h, w, b, i = (x.cuda() for x in (hidden, weight, bias, ids))
    t, k, p, m = as_row_tensors(configs, "cuda")
    out = {}
    for backend in ("fused", "native"):
        hh = h.clone().requires_grad_(True)
        lp, ent = rlkernel.linear_logp(hh, w, i, bias=b, temperature=t, top_k=k, top_p=p, min_p=m,
                                       return_entropy=True, backend=backend, logits_dtype=logits_dtype)
        (torch.where(torch.isinf(lp), 0.0, lp).sum() + ent.sum()).backward()
        out[backend] = (lp.cpu().double(), ent.cpu().double(), hh.grad.cpu().double())
    (lf, ef, gf), (ln, en, gn) = out["fused"], out["native"]
    same = torch.isinf(lf) == torch.isinf(ln)  # a token within rounding of a threshold may differ (contract 1)
    assert same.float().mean() > 0.95
    rows = same & torch.isfinite(lf) & torch.isfinite(ln)
    torch.testing.assert_close(lf[rows], ln[rows], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ef[same], en[same], atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(gf[same], gn[same], atol=2e-2, rtol=2e-2)
