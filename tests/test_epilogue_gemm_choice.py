"""rlkernel.ops.fused.epilogue_gemm's choice of kernel, the part a CPU reaches (issue 37): why a forward or a
backward does not take the epilogue GEMM, in the order the checks run, and the records that count the choices.
The GPU side (the kernels, and every reason that needs a CUDA device) is tests/test_linear_logp_epilogue.py."""
from __future__ import annotations

import pytest
import torch

from rlkernel.ops.fused import epilogue_gemm


@pytest.fixture
def switches(monkeypatch):
    """The module's switches as the tests set them, restored after; the records reset before and after."""
    monkeypatch.setattr(epilogue_gemm, "ENABLED", False)
    monkeypatch.setattr(epilogue_gemm, "GRAD", True)
    epilogue_gemm.reset_records()
    yield monkeypatch
    epilogue_gemm.reset_records()


def operands(dtype=torch.bfloat16):
    return torch.zeros(4, 16, dtype=dtype), torch.zeros(32, 16, dtype=dtype)


def test_forward_reason_says_switched_off_first(switches):
    h, w = operands(torch.float32)
    assert epilogue_gemm.reason(h, w, None, False, True, logits32=True) == (
        "switched off (rlkernel.ops.fused.epilogue_gemm.ENABLED)")
    switches.setattr(epilogue_gemm, "ENABLED", True)
    # True takes every call it covers: the "auto" arguments do not matter
    assert epilogue_gemm.reason(h, w, None, False, True, logits32=False, adds_recompute=True) == (
        "torch.float32 inputs (bfloat16 / float16 only)")
    switches.setattr(epilogue_gemm, "BATCH_INVARIANT", False)
    h16, w16 = operands()
    assert "batch_invariant=True" in epilogue_gemm.reason(h16, w16, None, True, True, logits32=False)


def test_gradient_epilogue_reasons_come_before_the_forward_ones(switches):
    """GRAD off, the option kernels and a bias gradient are the backward's own reasons, each named; without them
    the answer is the forward's reason for the same operands (no float32-output GEMM question: the gradient
    epilogue replaces it)."""
    h, w = operands()
    switches.setattr(epilogue_gemm, "GRAD", False)
    assert epilogue_gemm.grad_reason(h, w, None, False, False, None) == (
        "switched off (rlkernel.ops.fused.epilogue_gemm.GRAD)")
    switches.setattr(epilogue_gemm, "GRAD", True)
    assert epilogue_gemm.grad_reason(h, w, None, False, False, object()) == (
        "per-row temperature / softcap (the option kernels)")
    assert epilogue_gemm.grad_reason(h, w, None, False, True, None) == (
        "a bias gradient (summed from the float32 tile)")
    assert epilogue_gemm.grad_reason(h, w, None, False, False, None) == epilogue_gemm.reason(h, w, None, False, False,
                                                                                             logits32=True)
    switches.setattr(epilogue_gemm, "ENABLED", True)
    h32, w32 = operands(torch.float32)
    assert epilogue_gemm.grad_reason(h32, w32, None, False, False, None) == (
        "torch.float32 inputs (bfloat16 / float16 only)")


def test_records_count_forwards_and_backwards_apart(switches):
    epilogue_gemm.record("cublas", "why")
    epilogue_gemm.record("cublas", "why")
    epilogue_gemm.record_grad("tile", "a bias gradient (summed from the float32 tile)")
    epilogue_gemm.record_grad("epilogue")
    assert epilogue_gemm.records() == {("cublas", "why"): 2}
    assert epilogue_gemm.grad_records() == {("tile", "a bias gradient (summed from the float32 tile)"): 1,
                                            ("epilogue", ""): 1}
    epilogue_gemm.reset_records()
    assert epilogue_gemm.records() == {} and epilogue_gemm.grad_records() == {}


def test_auto_takes_float32_logits_calls_at_small_hidden_sizes_only(switches):
    """ENABLED='auto' is the measured policy: a larger hidden size, a call with 16-bit logits (the epilogue's
    float32 ones would make a call's log-probs depend on whether a backward runs), or a loss whose backward would
    then recompute the logits keeps the cuBLAS path, each with its own reason; past those the remaining checks run
    as with True (on CPU tensors the device check's reason, before any GPU query)."""
    switches.setattr(epilogue_gemm, "ENABLED", "auto")
    limit = epilogue_gemm.AUTO_MAX_HIDDEN
    wide = torch.zeros(2, limit + 8, dtype=torch.bfloat16), torch.zeros(4, limit + 8, dtype=torch.bfloat16)
    assert epilogue_gemm.reason(*wide, None, False, False, logits32=True) == (
        f"ENABLED='auto': hidden size > {limit} (the cuBLAS path measured faster at 4096)")
    h, w = operands()
    for need_backward in (False, True):
        assert epilogue_gemm.reason(h, w, None, False, need_backward, logits32=False) == (
            "ENABLED='auto': 16-bit logits asked for (the epilogue's are float32: the call's log-probs would depend "
            "on whether a backward runs)")
    assert epilogue_gemm.reason(h, w, None, False, True, logits32=True, adds_recompute=True) == (
        "ENABLED='auto': the backward would recompute the logits the cuBLAS path keeps (measured slower)")
    for need_backward in (False, True):  # float32 logits, with or without a backward: past the "auto" rules, to
        # the first check that needs a GPU (CPU tensors here)
        assert epilogue_gemm.reason(h, w, None, False, need_backward, logits32=True) == (
            "cpu tensors (a CUDA GPU only)")
    h32, w32 = operands(torch.float32)
    # float32 inputs are named as such before any "auto" rule (their logits are float32 whatever was asked)
    assert epilogue_gemm.reason(h32, w32, None, False, False, logits32=False) == (
        "torch.float32 inputs (bfloat16 / float16 only)")
    # the gradient epilogue is a float32-logits backward: only the hidden size rule applies to it
    assert epilogue_gemm.grad_reason(*wide, None, False, False, None).startswith("ENABLED='auto': hidden size")
    assert epilogue_gemm.grad_reason(h32, w32, None, False, False, None) == (
        "torch.float32 inputs (bfloat16 / float16 only)")


def test_reason_needs_the_logits_dtype_named(switches):
    """logits32 is keyword-only and required: a caller cannot leave "auto" to guess what the call asked for."""
    h, w = operands()
    with pytest.raises(TypeError, match="logits32"):
        epilogue_gemm.reason(h, w, None, False, False)


def test_a_bad_switch_value_is_refused(switches):
    switches.setattr(epilogue_gemm, "ENABLED", "on")
    h, w = operands()
    with pytest.raises(ValueError, match="False, True or 'auto'"):
        epilogue_gemm.reason(h, w, None, False, False, logits32=True)


def test_the_shipped_default_is_the_measured_policy():
    """docs/contracts.md: ENABLED ships as "auto" (the whole suite passed on the H200 with it, 2026-12-05); the
    other tests set it through monkeypatch, so a value left behind by one fails here too."""
    assert epilogue_gemm.ENABLED == "auto"
