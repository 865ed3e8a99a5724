"""The native logp backend against an independent float64 reference (CPU)."""
import pytest
import torch
from reference import logp_grad_ref, logp_ref

import rlkernel

# (dtype, atol, rtol). The reference is computed in float64 from the *same rounded* logits, so the only error
# is float32 arithmetic: a few ulps of the log-sum-exp, whose magnitude is log V + max|x| (<= ~30 here) -> 1e-4.
FORWARD_TOL = [(torch.float32, 1e-4, 1e-5), (torch.float16, 1e-4, 1e-5), (torch.bfloat16, 1e-4, 1e-5)]
# Gradients are rounded to the logits' dtype on the way out: half an ulp of values in [-1, 1].
GRAD_TOL = {torch.float32: (1e-6, 1e-5), torch.float16: (1e-6, 1e-3), torch.bfloat16: (1e-6, 8e-3)}


def _logits(shape, dtype, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _ids(shape, vocab, seed):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed + 7))


@pytest.mark.parametrize("dtype,atol,rtol", FORWARD_TOL)
@pytest.mark.parametrize("vocab", [1, 7, 4095, 50257])
def test_forward_and_entropy_match_float64(dtype, atol, rtol, vocab):
    rows = 5 if vocab > 4095 else 9
    logits = _logits((rows, vocab), dtype, vocab)
    ids = _ids((rows,), vocab, vocab)
    lp, ent = rlkernel.logp(logits, ids, return_entropy=True, backend="native")
    ref_lp, ref_ent = logp_ref(logits, ids)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    torch.testing.assert_close(lp.double(), ref_lp, atol=atol, rtol=rtol)
    torch.testing.assert_close(ent.double(), ref_ent, atol=atol, rtol=rtol)


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.5])
def test_temperature_ignore_index_and_3d_strided(temperature):
    base = _logits((3, 6, 2 * 101), torch.float32, 1)
    logits = base[..., 5:106].transpose(0, 1)  # [6, 3, 101], non-contiguous rows and leading dims
    ids = _ids((6, 3), 101, 2)
    ids[1, 2] = -100
    ids[4, 0] = -100
    lp, ent = rlkernel.logp(logits, ids, temperature=temperature, return_entropy=True, backend="native")
    ref_lp, ref_ent = logp_ref(logits, ids, temperature)
    assert lp.shape == (6, 3)
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-4, rtol=1e-5)
    assert lp[1, 2] == 0 and ent[4, 0] == 0


def test_custom_ignore_index_and_minus_inf_rows():
    logits = _logits((4, 33), torch.float32, 3)
    logits[0, :10] = float("-inf")  # some -inf: those tokens have p = 0
    logits[1, :] = float("-inf")  # no distribution at all: NaN by contract
    logits[2, 5] = float("nan")
    ids = torch.tensor([12, 3, 4, 7])
    lp, ent = rlkernel.logp(logits, ids, ignore_index=7, return_entropy=True, backend="native")
    ref_lp, ref_ent = logp_ref(logits, ids, ignore_index=7)
    torch.testing.assert_close(lp[0].double(), ref_lp[0], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ent[0].double(), ref_ent[0], atol=1e-4, rtol=1e-5)
    assert torch.isnan(lp[1]) and torch.isnan(ent[1]) and torch.isnan(lp[2]) and torch.isnan(ent[2])
    assert lp[3] == 0 and ent[3] == 0
    lp0 = rlkernel.logp(logits[:1], torch.tensor([2]), backend="native")
    assert lp0[0] == float("-inf")  # target with a -inf logit


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_gradients_match_float64_autograd(dtype, with_entropy):
    vocab, rows = 257, 6
    logits = _logits((rows, vocab), dtype, 11).requires_grad_(True)
    ids = _ids((rows,), vocab, 11)
    ids[2] = -100
    g = torch.Generator().manual_seed(5)
    g_lp = torch.randn(rows, generator=g)
    g_ent = torch.randn(rows, generator=g) if with_entropy else None
    lp, ent = rlkernel.logp(logits, ids, temperature=0.7, return_entropy=True, backend="native")
    loss = (g_lp * lp).sum() + ((g_ent * ent).sum() if with_entropy else 0)
    loss.backward()
    ref = logp_grad_ref(logits, ids, g_lp, g_ent, temperature=0.7)
    atol, rtol = GRAD_TOL[dtype]
    assert logits.grad.dtype == dtype
    torch.testing.assert_close(logits.grad.double(), ref, atol=atol, rtol=rtol)
    assert torch.all(logits.grad[2] == 0)  # ignored row: no gradient


def test_gradcheck_small_shapes():
    from rlkernel.ops.native.logp import logp_native

    logits = _logits((3, 17), torch.float64, 4).requires_grad_(True)
    ids = torch.tensor([1, -100, 16])

    def f(x):
        lp, ent = logp_native(x, ids, temperature=1.3, ignore_index=-100, return_entropy=True, keep_dtype=True)
        return lp, ent

    assert torch.autograd.gradcheck(f, (logits,), eps=1e-6, atol=1e-7)


def test_empty_inputs_give_empty_outputs():
    lp, ent = rlkernel.logp(torch.randn(0, 11), torch.zeros(0, dtype=torch.long), return_entropy=True)
    assert lp.shape == (0,) and ent.shape == (0,)
    assert rlkernel.logp(torch.randn(2, 0, 5), torch.zeros(2, 0, dtype=torch.long)).shape == (2, 0)


def test_bad_input_errors():
    logits = _logits((2, 3, 5), torch.float32, 0)
    ids = _ids((2, 3), 5, 0)
    with pytest.raises(TypeError, match="floating"):
        rlkernel.logp(torch.ones(2, 5, dtype=torch.long), ids[:, 0])
    with pytest.raises(ValueError, match=r"\(2, 4\).*\(2, 3\)"):
        rlkernel.logp(logits, torch.zeros(2, 4, dtype=torch.long))
    for bad_t in (-1.0, float("inf"), float("nan"), 1e-45):
        with pytest.raises(ValueError, match="temperature"):
            rlkernel.logp(logits, ids, temperature=bad_t)
    # T = 0 is the greedy distribution (a processed log-prob): 0 for the argmax, -inf for any other id
    greedy = rlkernel.logp(logits, logits.argmax(-1), temperature=0)
    assert torch.equal(greedy, torch.zeros(2, 3))
    assert torch.all(rlkernel.logp(logits, (logits.argmax(-1) + 1) % 5, temperature=0) == float("-inf"))
    with pytest.raises(TypeError, match="integer"):
        rlkernel.logp(logits, ids.float())
    ids[1, 2] = 5
    ids[0, 0] = -3
    with pytest.raises(IndexError, match=r"\(0, 0\)"):
        rlkernel.logp(logits, ids)


def test_ignored_all_minus_inf_row_gets_no_gradient():
    logits = _logits((3, 9), torch.float32, 8)
    logits[1] = float("-inf")
    logits.requires_grad_(True)
    ids = torch.tensor([2, -100, 4])
    lp, ent = rlkernel.logp(logits, ids, return_entropy=True, backend="native")
    (lp.sum() + ent.sum()).backward()
    assert lp[1] == 0 and ent[1] == 0
    assert torch.all(logits.grad[1] == 0) and torch.isfinite(logits.grad).all()
