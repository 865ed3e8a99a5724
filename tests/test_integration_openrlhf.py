"""rlkernel.integrations.openrlhf against the real OpenRLHF (installed with --no-deps, with deepspeed): its
``openrlhf.models.utils.log_probs_from_logits`` and ``compute_entropy``, called as ``Actor.forward`` calls them,
give OpenRLHF's own values and gradients through rlkernel.logp, in OpenRLHF's dtypes, with its in-place
temperature; modules that imported them by name see the patch; undo restores them. ``openrlhf.models`` imports
``Actor`` (peft, flash_attn: no CPU build), so the utils module is loaded without running that package's
``__init__`` where it cannot be; Actor.forward itself is untested here. Skipped without openrlhf; required in
`tox -e openrlhf` (tests/integration_support.py)."""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from integration_support import framework  # noqa: E402

framework("openrlhf", "openrlhf")

import rlkernel  # noqa: E402
from rlkernel import dispatch  # noqa: E402
from rlkernel.integrations import UnsupportedVersionError  # noqa: E402
from rlkernel.integrations import openrlhf as rk_orl  # noqa: E402


def _utils():
    """openrlhf.models.utils; where openrlhf.models' __init__ cannot import (Actor needs peft and flash_attn), as a
    bare package (its __init__ not run) holding the real utils module."""
    try:
        return importlib.import_module("openrlhf.models.utils")
    except ImportError:
        pass
    models = types.ModuleType("openrlhf.models")
    models.__path__ = [str(Path(importlib.util.find_spec("openrlhf").origin).parent / "models")]
    sys.modules["openrlhf.models"] = models
    return importlib.import_module("openrlhf.models.utils")


utils = _utils()
ORIGINAL_LOGP = utils.log_probs_from_logits
ORIGINAL_ENTROPY = utils.compute_entropy
# compute_entropy is torch.compile'd; its Python function is the reference (no compile of the test's own)
ENTROPY_REF = getattr(ORIGINAL_ENTROPY, "_torchdynamo_orig_callable", ORIGINAL_ENTROPY)


def _logits(dtype=torch.float32, b=3, s=7, v=61):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(b, s, v, generator=g) * 2).to(dtype).requires_grad_()
    return logits, torch.randint(0, v, (b, s), generator=g)


def _scaled_then(fn, logits, *args):
    """fn on a fresh non-leaf copy of the logits (OpenRLHF's temperature divides in place), with its gradient."""
    x = logits.detach().clone().requires_grad_()
    y = x * 1.0  # a non-leaf, as the model's logits are
    out = fn(y, *args)
    out.float().sum().backward()
    return out.detach(), x.grad, y.detach()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_from_logits_equals_openrlhfs_with_its_in_place_temperature(temperature):
    logits, labels = _logits()
    ref, ref_g, ref_scaled = _scaled_then(ORIGINAL_LOGP, logits, labels, temperature)
    with rk_orl.apply(), dispatch.recording() as rec:
        assert utils.log_probs_from_logits is rk_orl.log_probs_from_logits
        got, g, scaled = _scaled_then(utils.log_probs_from_logits, logits, labels, temperature)
    assert {r.op for r, _ in rec.records} == {"logp.forward", "logp.backward"}  # rlkernel's op ran
    assert got.dtype == ref.dtype == torch.float32 and got.shape == (3, 7)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g, ref_g, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scaled, ref_scaled, rtol=0, atol=0)  # the logits divided in place, as OpenRLHF does


def test_bf16_logits_keep_openrlhfs_dtype():
    logits, labels = _logits(torch.bfloat16)
    ref = ORIGINAL_LOGP(logits.detach().clone(), labels)
    with rk_orl.apply():
        got = utils.log_probs_from_logits(logits.detach().clone(), labels)
    assert got.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=5e-2)  # OpenRLHF computes in bf16


def test_compute_entropy_equals_openrlhfs():
    logits, _ = _logits()
    ref, ref_g, _ = _scaled_then(ENTROPY_REF, logits)
    with rk_orl.apply(), dispatch.recording() as rec:
        got, g, _ = _scaled_then(utils.compute_entropy, logits)
    assert {r.op for r, _ in rec.records} == {"logp.forward", "logp.backward"}
    assert got.shape == (3, 7) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g, ref_g, rtol=1e-5, atol=1e-6)


def test_modules_that_imported_the_functions_by_name_are_patched_and_restored():
    consumer = types.ModuleType("openrlhf._rlkernel_test_consumer")  # as openrlhf.models.actor binds them
    consumer.log_probs_from_logits, consumer.compute_entropy = ORIGINAL_LOGP, ORIGINAL_ENTROPY
    sys.modules[consumer.__name__] = consumer
    try:
        with rk_orl.apply():
            assert consumer.log_probs_from_logits is rk_orl.log_probs_from_logits
            assert consumer.compute_entropy is rk_orl.compute_entropy
        assert consumer.log_probs_from_logits is ORIGINAL_LOGP and consumer.compute_entropy is ORIGINAL_ENTROPY
    finally:
        del sys.modules[consumer.__name__]


def test_apply_is_idempotent_undoes_and_checks_the_version(monkeypatch):
    p = rk_orl.apply()
    assert rk_orl.apply() is p
    with pytest.raises(ValueError, match="already applied"):
        rk_orl.apply(backend="native")
    p.undo()
    assert utils.log_probs_from_logits is ORIGINAL_LOGP and utils.compute_entropy is ORIGINAL_ENTROPY
    with rk_orl.apply(backend="native"):
        logits, labels = _logits()
        with dispatch.recording() as rec:
            utils.log_probs_from_logits(logits.detach(), labels)
        assert [r.status for r, _ in rec.records] == ["native"]
    with rk_orl.apply(phases=False) as q:  # no phase range either way (the module docstring says why)
        assert q.options == {"backend": "auto", "require_fused": False, "phases": False}
        logits, labels = _logits()
        assert utils.log_probs_from_logits(logits.detach(), labels).shape == labels.shape  # no op keyword
    with pytest.raises(ValueError, match="contradicts"):
        rk_orl.apply(backend="native", require_fused=True)
    monkeypatch.setattr(rk_orl.metadata, "version", lambda name: "0.10.3")
    with pytest.raises(UnsupportedVersionError, match="supports openrlhf >=0.11,<0.12; found openrlhf 0.10.3"):
        rk_orl.apply()


def test_require_fused_on_cpu_is_blocked_by_the_op():
    logits, labels = _logits()
    with rk_orl.apply(require_fused=True), pytest.raises(rlkernel.FusedKernelUnavailable):
        utils.log_probs_from_logits(logits.detach(), labels)


def test_a_refused_call_leaves_the_logits_as_they_were():
    """The contract's 'blocked before any work': the in-place temperature division is not done for a call that
    rlkernel.logp refuses (a fused path demanded on CPU, labels of the wrong shape)."""
    logits, labels = _logits()
    before = logits.detach().clone()
    x = logits.detach().clone()
    with rk_orl.apply(backend="fused"), pytest.raises(rlkernel.FusedKernelUnavailable):
        utils.log_probs_from_logits(x, labels, temperature=0.5)
    assert torch.equal(x, before)
    with rk_orl.apply(), pytest.raises(ValueError):
        utils.log_probs_from_logits(x, labels[:, :-1], temperature=0.5)
    assert torch.equal(x, before)


def test_a_module_bound_while_applied_calls_openrlhfs_own_after_undo():
    """A module imported while the patch is active binds the replacement; after undo() the replacement runs
    OpenRLHF's own function again (no rlkernel record, OpenRLHF's values)."""
    with rk_orl.apply():
        bound_logp, bound_entropy = utils.log_probs_from_logits, utils.compute_entropy
    logits, labels = _logits()
    with dispatch.recording() as rec:
        got = bound_logp(logits.detach().clone(), labels, 0.7)
        ent = bound_entropy(logits.detach())
    assert rec.records == []
    assert torch.equal(got, ORIGINAL_LOGP(logits.detach().clone(), labels, 0.7))
    assert torch.equal(ent, ORIGINAL_ENTROPY(logits.detach()))
