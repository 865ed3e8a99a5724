"""The torch-free view of the registry (rlkernel.workload_catalog) and the tools that read it without torch
(issue 40): the analyzer on a trace of the project's own workloads, and ``pipelines.capture --help``."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rlkernel import workload_catalog, workloads
from rlkernel.numerics import DTYPES
from tests.subprocess_env import pythonpath

ROOT = Path(__file__).resolve().parent.parent


def test_catalog_agrees_with_the_registry_for_every_workload():
    assert workload_catalog.names() == workloads.names()  # order included: capture and the suite run in it
    for name in workloads.names():
        w = workloads.get(name)
        assert workload_catalog.CATALOG[name] == {"op": w.op, "path": w.path, "fused_ops": list(w.fused_ops),
                                                  "fused_patterns": list(w.fused_patterns)}, name
    assert workload_catalog.DTYPE_NAMES == tuple(DTYPES)


def _python(code: str, *args, cwd=None):
    env = dict(os.environ, PYTHONPATH=pythonpath())
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          env=env, cwd=cwd)


_AS_MAIN = """
import runpy, sys
module, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
try:
    runpy.run_module(module, run_name="__main__")
except SystemExit as e:
    code = e.code
print("TORCH-IMPORTED" if "torch" in sys.modules else "NO-TORCH", code)
"""


def test_analyze_on_the_bundled_example_imports_no_torch(tmp_path):
    out = _python(_AS_MAIN, "pipelines.analyze", "--out", str(tmp_path / "report"), cwd=tmp_path)
    assert out.stdout.strip().splitlines()[-1] == "NO-TORCH 0", out.stdout[-2000:] + out.stderr[-2000:]
    # the registry's verdicts still apply: the example's fused workloads are judged as such
    assert "logp-fused: fused" in out.stdout, out.stdout


def test_capture_help_imports_no_torch_and_shows_the_shape_defaults():
    out = _python(_AS_MAIN, "pipelines.capture", "--help")
    assert out.stdout.strip().splitlines()[-1] == "NO-TORCH 0", out.stdout[-2000:] + out.stderr[-2000:]
    text = " ".join(out.stdout.split())
    for default in ("(default 8)", "(default 512)", "(default 128256)", "(default bfloat16)", "(default 50)",
                    "(default 0.9)", "(default 1.0)"):
        assert default in text, default
    assert "logp-fused" in text and "node-kit" not in text and "install Nsight Systems" in text
