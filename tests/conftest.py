import os

import pytest
import torch

import rlkernel


def pytest_configure(config):
    """Under pytest-xdist (``-n N``) each worker, and the processes its tests start, get a share of the cores for
    torch's CPU threads instead of all of them: N workers of one thread per core each oversubscribe the machine, and
    small CPU ops then wait on OpenMP barriers: tests/fused_on_cpu.py takes 10 s alone on a 2-core machine, 46 s as
    three copies at once with 8 threads each there (12 s with 1 each), and took 358 s inside the H200 suite at
    -n 14 on 16 cores. An OMP_NUM_THREADS the caller set is left as it is."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        share = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(share)
        os.environ["OMP_NUM_THREADS"] = str(share)


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
