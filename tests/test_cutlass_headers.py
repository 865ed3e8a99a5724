"""rlkernel/cutlass_headers.py: where the epilogue GEMM's CUTLASS / CuTe headers come from (CPU only)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlkernel import cutlass_headers

ROOT = Path(__file__).resolve().parents[1]


def test_one_pin_everywhere():
    """pyproject's cuda extra and tox's csrc env pin the wheel the module names."""
    assert f'"{cutlass_headers.PIN}"' in (ROOT / "pyproject.toml").read_text()
    tox = (ROOT / "tox.ini").read_text()
    csrc = tox[tox.index("[testenv:csrc]"):]
    csrc = csrc[:csrc.index("\n[", 1)]
    assert cutlass_headers.PIN in csrc


def test_script_prints_the_folder_the_module_finds():
    """The compile gate runs the file as a script (no rlkernel import): same answer as the module."""
    out = subprocess.run([sys.executable, str(ROOT / "rlkernel" / "cutlass_headers.py")], capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == (cutlass_headers.include_dir() or "")


def test_installed_wheel_has_the_headers_the_kernel_includes():
    inc = cutlass_headers.include_dir()
    if inc is None:
        pytest.skip("nvidia-cutlass is not installed")
    for header in ("cute/tensor.hpp", "cutlass/gemm/collective/collective_builder.hpp",
                   "cutlass/epilogue/collective/detail.hpp", "cutlass/gemm/kernel/gemm_universal.hpp"):
        assert (Path(inc) / header).is_file(), header
    assert cutlass_headers.PIN == f"nvidia-cutlass=={cutlass_headers.version()}"
