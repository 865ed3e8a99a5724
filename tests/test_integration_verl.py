"""rlkernel.integrations.verl against the real verl: a model patched by verl's own
``patch_forward_with_backends(use_fused_kernels=True, fused_kernels_backend="triton")`` computes its log-probs and
entropy through rlkernel (verl's Triton kernel needs CUDA; the reference is verl's torch backend on the same
model), ``logprobs_from_logits`` / ``entropy_from_logits`` equal verl's own and are rebound in a verl module that
imported them by name, and every fallback goes to verl's own kernel with its reason (a spy stands in for its
forward, which needs CUDA and Triton), a two-rank tensor-parallel group included.
Skipped without verl; required in `tox -e verl` (tests/integration_support.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from integration_support import framework  # noqa: E402

framework("verl", "verl")

import transformers as tf  # noqa: E402
from verl.models.transformers.monkey_patch import patch_forward_with_backends  # noqa: E402
from verl.utils import torch_functional as verl_F  # noqa: E402
from verl.utils.kernel import linear_cross_entropy as verl_lce  # noqa: E402

import rlkernel  # noqa: E402
from rlkernel import dispatch  # noqa: E402
from rlkernel.integrations import UnsupportedVersionError  # noqa: E402
from rlkernel.integrations import verl as rk_verl  # noqa: E402

ORIGINALS = {"linear_cross_entropy": verl_lce.linear_cross_entropy, "logprobs": verl_F.logprobs_from_logits,
             "entropy": verl_F.entropy_from_logits}


@pytest.fixture
def verl_forward():
    """A tiny Qwen2 whose class forward verl patches for a fused-kernel backend; the class is restored after."""
    torch.manual_seed(0)
    model = tf.Qwen2ForCausalLM(tf.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48,
                                               num_hidden_layers=1, num_attention_heads=4,
                                               num_key_value_heads=2)).eval()
    original = type(model).forward

    def run(backend, ids, temperature):
        patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend=backend)
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, temperature=temperature, return_dict=True)
        (out.log_probs.sum() + 0.1 * out.entropy.sum()).backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    yield run
    type(model).forward = original


def test_verls_fused_forward_runs_rlkernel_with_verls_torch_backend_values(verl_forward):
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    ref, ref_g = verl_forward("torch", ids, 0.7)
    with rk_verl.apply(), dispatch.recording() as rec:
        got, g = verl_forward("triton", ids, 0.7)
    assert {r.op for r, _ in rec.records} == {"linear_logp.forward", "linear_logp.backward"}
    assert got.log_probs.shape == ref.log_probs.shape == (2, 9) and got.log_probs.dtype == torch.float32
    torch.testing.assert_close(got.log_probs, ref.log_probs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.entropy, ref.entropy, rtol=1e-5, atol=1e-5)
    assert ref_g.keys() == g.keys()
    for n in ref_g:
        torch.testing.assert_close(g[n], ref_g[n], rtol=1e-4, atol=1e-6)


def _logits(dtype=torch.float32):
    g = torch.Generator().manual_seed(2)
    return (torch.randn(3, 5, 47, generator=g) * 2).to(dtype), torch.randint(0, 47, (3, 5), generator=g)


def _with_grad(fn, logits, *args):
    x = logits.clone().requires_grad_()
    out = fn(x * 1.0, *args)
    out.float().sum().backward()
    return out.detach(), x.grad


def test_logprobs_and_entropy_from_logits_equal_verls():
    logits, labels = _logits()
    ref_lp, ref_lp_g = _with_grad(ORIGINALS["logprobs"], logits, labels)
    ref_ent, ref_ent_g = _with_grad(ORIGINALS["entropy"], logits)
    with rk_verl.apply(), dispatch.recording() as rec:
        lp, lp_g = _with_grad(verl_F.logprobs_from_logits, logits, labels)
        ent, ent_g = _with_grad(verl_F.entropy_from_logits, logits)
    assert {r.op for r, _ in rec.records} == {"logp.forward", "logp.backward"}
    for got, ref in ((lp, ref_lp), (lp_g, ref_lp_g), (ent, ref_ent), (ent_g, ref_ent_g)):
        assert got.shape == ref.shape and got.dtype == ref.dtype
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    bf16, _ = _logits(torch.bfloat16)
    with rk_verl.apply():
        assert verl_F.entropy_from_logits(bf16).dtype == torch.bfloat16  # verl's own dtype
        assert verl_F.logprobs_from_logits(bf16, labels).dtype == torch.float32  # as verl's flash-attn path


def test_a_module_that_imported_them_by_name_is_patched_and_restored():
    from verl.workers.rollout.naive import naive_rollout  # binds logprobs_from_logits at import

    assert naive_rollout.logprobs_from_logits is ORIGINALS["logprobs"]
    with rk_verl.apply():
        assert naive_rollout.logprobs_from_logits is rk_verl.logprobs_from_logits
    assert naive_rollout.logprobs_from_logits is ORIGINALS["logprobs"]


def _head(dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    return (torch.randn(11, 16, generator=g, dtype=dtype), torch.randn(40, 16, generator=g, dtype=dtype),
            torch.randint(0, 40, (11,), generator=g))


FALLBACKS = {
    "reduction": (dict(reduction="mean"), "reduction='mean' not supported (rlkernel returns per-token values: 'none')"),
    "temperature_tensor": (dict(temperature=torch.full((11,), 0.7)),
                           "a temperature tensor is not supported (per-token temperatures: not yet)"),
    "autocast": (dict(autocast=True),
                 "mixed dtypes (hidden float32, weight float32, compute bfloat16): the ops take one dtype"),
}


class VerlKernelSpy:
    """Stands in for verl's LinearCrossEntropy.forward (CUDA and Triton only): counts the calls, returns zeros."""

    def __init__(self, setattr_):
        self.calls = []
        spy = self

        def forward(ctx, hidden, weight, labels, temperature=1.0, reduction="none", dist_process_group=None):
            spy.calls.append((tuple(hidden.shape), reduction))
            n = hidden.reshape(-1, hidden.shape[-1]).shape[0]
            return hidden.new_zeros(n, dtype=torch.float32), hidden.new_zeros(n, dtype=torch.float32)

        setattr_(verl_lce.LinearCrossEntropy, "forward", staticmethod(forward))


@pytest.mark.parametrize("case", sorted(FALLBACKS))
def test_every_fallback_goes_to_verls_kernel_with_its_reason(case, monkeypatch):
    kwargs, reason = FALLBACKS[case]
    kwargs = dict(kwargs)
    autocast = kwargs.pop("autocast", False)
    hidden, weight, labels = _head()
    args = dict(temperature=0.7, reduction="none") | kwargs
    spy = VerlKernelSpy(monkeypatch.setattr)
    with rk_verl.apply(), dispatch.recording() as rec, torch.autocast("cpu", dtype=torch.bfloat16,
                                                                      enabled=autocast):
        verl_lce.linear_cross_entropy(hidden, weight, labels, args["temperature"], args["reduction"])
    assert spy.calls == [((11, 16), args["reduction"])]  # verl's own kernel ran
    assert [r for r, _ in rec.records] == [dispatch.Dispatch(rk_verl.OP, "auto", "framework", "fallback", reason)]


def test_plain_call_of_verls_head_by_rlkernel_has_verls_signature():
    hidden, weight, labels = _head()
    ref = torch.log_softmax((hidden @ weight.T) / 0.7, -1)
    with rk_verl.apply(), dispatch.recording() as rec:
        lp, ent = verl_lce.linear_cross_entropy(hidden, weight, labels, 0.7, "none", None)
    assert {r.op for r, _ in rec.records} == {"linear_logp.forward"}
    torch.testing.assert_close(lp, ref.gather(-1, labels[:, None]).squeeze(-1))
    torch.testing.assert_close(ent, -(ref.exp() * ref).sum(-1))


def _tp_worker(rank, world, init_file, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        spy = VerlKernelSpy(setattr)  # this child process only
        hidden, weight, labels = _head()
        with rk_verl.apply(), dispatch.recording() as rec:
            verl_lce.linear_cross_entropy(hidden, weight, labels, 1.0, "none", dist.group.WORLD)
        torch.save({"verl_calls": len(spy.calls), "records": [tuple(r) for r, _ in rec.records]},
                   Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_a_tensor_parallel_group_of_two_ranks_goes_to_verls_kernel(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_tp_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert got["verl_calls"] == 1
        assert got["records"] == [(rk_verl.OP, "auto", "framework", "fallback",
                                   "a tensor-parallel group of 2 ranks: vocab-parallel heads are not supported")]


def test_apply_is_idempotent_undoes_and_checks_the_version(monkeypatch):
    p = rk_verl.apply()
    assert rk_verl.apply() is p and verl_lce.linear_cross_entropy is rk_verl.linear_cross_entropy
    with pytest.raises(ValueError, match="already applied"):
        rk_verl.apply(backend="native")
    p.undo()
    assert verl_lce.linear_cross_entropy is ORIGINALS["linear_cross_entropy"]
    assert verl_F.logprobs_from_logits is ORIGINALS["logprobs"] and verl_F.entropy_from_logits is ORIGINALS["entropy"]
    with rk_verl.apply(require_fused=True), pytest.raises(rlkernel.FusedKernelUnavailable):
        verl_F.logprobs_from_logits(*_logits())
    with rk_verl.apply(phases=False) as q:  # no phase range either way (the module docstring says why)
        assert q.options == {"backend": "auto", "require_fused": False, "phases": False}
        assert verl_F.logprobs_from_logits(*_logits()).dtype == torch.float32  # phases is no op keyword
    monkeypatch.setattr(sys.modules["verl"], "__version__", "0.8.0")
    with pytest.raises(UnsupportedVersionError, match="supports verl >=0.9,<0.10; found verl 0.8.0"):
        rk_verl.apply()


def test_a_module_bound_while_applied_calls_verls_own_after_undo(monkeypatch):
    """A module imported while the patch is active binds the replacements (as verl.models.mcore.model_forward_fused
    binds linear_cross_entropy); after undo() they run verl's own functions again: its kernel, its values, no
    rlkernel record (the head once raised KeyError: its original had gone with the patch's state)."""
    with rk_verl.apply(backend="native"):
        lce, logprobs, entropy = (verl_lce.linear_cross_entropy, verl_F.logprobs_from_logits,
                                  verl_F.entropy_from_logits)
    assert lce is rk_verl.linear_cross_entropy
    spy = VerlKernelSpy(monkeypatch.setattr)
    hidden, weight, labels = _head()
    logits, ids = _logits()
    with dispatch.recording() as rec:
        lce(hidden, weight, labels, 1.0, "mean")
        got_lp, got_ent = logprobs(logits, ids), entropy(logits)
    assert spy.calls == [((11, 16), "mean")] and rec.records == []
    assert torch.equal(got_lp, ORIGINALS["logprobs"](logits, ids))
    assert torch.equal(got_ent, ORIGINALS["entropy"](logits))
