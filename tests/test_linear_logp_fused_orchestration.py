"""The fused paths' Python orchestration (blocks, chunks, casts, dW accumulation modes, masks, the loss's fused pass)
on CPU with stand-ins for the CUDA kernels, in a subprocess (the stand-ins register CPU kernels process-wide):
tests/fused_on_cpu.py says what is checked and what is not."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.subprocess_env import pythonpath

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("epilogue", [None, "False"], ids=["default", "epilogue-off"])
def test_fused_orchestration_matches_native_on_cpu(epilogue):
    """epilogue: rlkernel.ops.fused.epilogue_gemm.ENABLED for the run (None: the shipped default, "auto")."""
    env = dict(os.environ, PYTHONPATH=pythonpath())
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "fused_on_cpu.py"), *([epilogue] if epilogue else [])],
                          capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("ALL OK"), (proc.stdout[-3000:] +
                                                                              proc.stderr[-3000:])
