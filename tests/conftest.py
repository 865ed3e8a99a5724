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
