import pytest
import torch

import rlkernel


@pytest.fixture(autouse=True)
def _fresh_dispatch(monkeypatch):
    """Each test starts with an empty dispatch history and no strict flag from the caller's environment."""
    monkeypatch.delenv("RLKERNEL_REQUIRE_FUSED", raising=False)
    rlkernel.dispatch.reset()
    yield


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def fused_linear():
    """The fused linear_logp backend module on a CUDA machine (a machine with CUDA but without the built extension
    fails: its fused tests would otherwise test nothing); the device error record checked clean before, cleared
    after."""
    import contextlib

    from rlkernel import _ext

    reason = _ext.unavailable_reason()
    if reason:
        pytest.fail(f"CUDA is available but rlkernel._C is not: {reason} (python setup.py build_ext --inplace)")
    from rlkernel.ops.fused import linear_logp as linear_logp_fused

    rlkernel.check_errors()
    yield linear_logp_fused
    with contextlib.suppress(IndexError, ValueError):
        rlkernel.check_errors()
