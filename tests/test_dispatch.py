"""Dispatch never hides a fallback: every status and op, on CPU (docs/contracts.md, section 2)."""
import warnings

import pytest
import torch

import rlkernel
from rlkernel import dispatch
from rlkernel.dispatch import Dispatch, FusedKernelUnavailable

pytestmark = pytest.mark.smoke


def _inputs(rows=4, vocab=13):
    g = torch.Generator().manual_seed(0)
    return torch.randn(rows, vocab, generator=g), torch.randint(0, vocab, (rows,), generator=g)


def test_auto_on_cpu_falls_back_with_reason_and_warns_once():
    logits, ids = _inputs()
    with pytest.warns(rlkernel.FallbackWarning, match="tensor on cpu"):
        rlkernel.logp(logits, ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second fallback for the same (op, reason) stays quiet
        rlkernel.logp(logits, ids)
    assert dispatch.history() == [(Dispatch("logp.forward", "auto", "native", "fallback", "tensor on cpu"), 2)]


def test_native_requested_is_native():
    logits, ids = _inputs()
    rlkernel.logp(logits, ids, backend="native")
    rlkernel.sample(logits, backend="native")
    assert dict(dispatch.history()) == {
        Dispatch("logp.forward", "native", "native", "native", ""): 1,
        Dispatch("sample", "native", "native", "native", ""): 1,
    }


def test_backward_is_recorded_when_it_runs_with_its_forward_status():
    logits, ids = _inputs()
    logits.requires_grad_(True)
    with dispatch.recording() as rec:
        out = rlkernel.logp(logits, ids)
        assert rec.statuses("logp.backward") == set()  # nothing recorded before the backward runs
        out.sum().backward()
    assert dict(rec.records)[Dispatch("logp.backward", "auto", "native", "fallback", "tensor on cpu")] == 1
    assert logits.grad is not None


@pytest.mark.parametrize("kwargs", [{"backend": "fused"}, {"require_fused": True}])
def test_strict_raises_before_any_work_and_records_blocked(kwargs):
    logits, ids = _inputs()
    with pytest.raises(FusedKernelUnavailable, match="tensor on cpu"):
        rlkernel.logp(logits, ids, **kwargs)
    with pytest.raises(FusedKernelUnavailable):
        rlkernel.sample(logits, **kwargs)
    statuses = {(r.op, r.status) for r, _ in dispatch.history()}
    assert statuses == {("logp.forward", "blocked"), ("sample", "blocked")}


def test_env_variable_makes_auto_strict(monkeypatch):
    monkeypatch.setenv("RLKERNEL_REQUIRE_FUSED", "1")
    logits, ids = _inputs()
    with pytest.raises(FusedKernelUnavailable):
        rlkernel.logp(logits, ids)
    rlkernel.logp(logits, ids, backend="native")  # an explicit native request is not overridden by the env


def test_unsupported_dtype_reason():
    logits, ids = _inputs()
    assert dispatch.fused_unavailable_reason("logp.forward", torch.device("cuda"), torch.float64) \
        == "dtype float64 unsupported"
    rlkernel.logp(logits.double(), ids)
    (rec, _), = dispatch.history()
    assert rec.status == "fallback" and rec.reason == "tensor on cpu"  # the device is the first reason


def test_extension_missing_reason_on_cuda_device():
    # On a machine without the built extension a CUDA tensor would fall back for this reason.
    from rlkernel import _ext

    if _ext.unavailable_reason() is None:
        pytest.skip("extension is built here")
    assert dispatch.fused_unavailable_reason("logp.forward", torch.device("cuda"), torch.bfloat16) \
        == "extension not built"
    with pytest.raises(_ext.ExtensionNotBuilt):
        _ext.load()


def test_sample_records_and_history_reset_and_recording_blocks():
    logits, _ = _inputs()
    rlkernel.sample(logits, top_k=3)
    with dispatch.recording() as rec:
        rlkernel.sample(logits, backend="native")
    assert rec.records == [(Dispatch("sample", "native", "native", "native", ""), 1)]
    assert len(dispatch.history()) == 2
    dispatch.reset()
    assert dispatch.history() == []


def test_history_json_form():
    logits, ids = _inputs()
    rlkernel.logp(logits, ids, backend="native")
    assert dispatch.history_json() == [{"op": "logp.forward", "requested": "native", "backend": "native",
                                        "status": "native", "reason": "", "count": 1}]


def test_worst_status_order():
    assert dispatch.worst(["native", "fused"]) == "fused"
    assert dispatch.worst(["fused", "fallback", "native"]) == "fallback"
    assert dispatch.worst(["fallback", "blocked"]) == "blocked"
    assert dispatch.worst([]) is None


def test_bad_backend_and_contradiction():
    logits, ids = _inputs()
    with pytest.raises(ValueError, match="backend"):
        rlkernel.logp(logits, ids, backend="triton")
    with pytest.raises(ValueError, match="contradicts"):
        rlkernel.logp(logits, ids, backend="native", require_fused=True)


def test_nested_recordings_each_see_their_records():
    logits, ids = _inputs()
    with dispatch.recording() as outer:
        with dispatch.recording() as inner:  # both empty: equal Counters must not be confused on exit
            pass
        rlkernel.logp(logits, ids, backend="native")
    assert inner.records == []
    assert outer.records == [(Dispatch("logp.forward", "native", "native", "native", ""), 1)]


def test_sampler_logprobs_are_part_of_the_sample_op():
    # the rollout's log-probs belong to `sample`: no logp record (nor, in a trace, a logp op range) for them
    logits, _ = _inputs()
    rlkernel.sample(logits, top_k=3, return_logprobs=True, backend="native")
    assert [r.op for r, _ in dispatch.history()] == ["sample"]
