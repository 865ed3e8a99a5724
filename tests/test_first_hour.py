"""A new user's first hour (issue 40): the things the README tells them, checked as they would meet them."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.subprocess_env import pythonpath

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()

_SNIPPET = """
import torch, rlkernel
logits = torch.randn(4, 32)
ids = torch.randint(0, 32, (4,))
rlkernel.logp(logits, ids, return_entropy=True)
rlkernel.sample(logits, top_k=5, top_p=0.9, return_logprobs=True)
print("done")
"""


def _python(*args):
    env = dict(os.environ, PYTHONPATH=pythonpath())
    env.pop("PYTHONWARNINGS", None)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, env=env)


def test_the_filter_the_readme_names_silences_the_cpu_fallback_warnings():
    plain = _python("-c", _SNIPPET)
    assert plain.returncode == 0 and plain.stdout.strip() == "done", plain.stderr
    assert plain.stderr.count("FallbackWarning") == 2  # what the README says a CPU prints
    quiet = _python("-c", 'import warnings, rlkernel\n'
                          'warnings.filterwarnings("ignore", category=rlkernel.FallbackWarning)\n' + _SNIPPET)
    assert quiet.returncode == 0 and quiet.stdout.strip() == "done"
    assert quiet.stderr == ""
    assert 'warnings.filterwarnings("ignore", category=rlkernel.FallbackWarning)' in README


def test_naming_the_warning_needs_no_torch():
    out = _python("-c", "import sys, rlkernel; rlkernel.FallbackWarning; print('torch' in sys.modules)")
    assert (out.stdout.strip(), out.stderr) == ("False", "")


def test_the_fallback_warning_is_one_class():
    import rlkernel
    from rlkernel import dispatch

    assert dispatch.FallbackWarning is rlkernel.FallbackWarning and issubclass(rlkernel.FallbackWarning, UserWarning)


@pytest.mark.parametrize("name", ["linear_logp", "linear_logp_loss", "examples/grpo_hf.py", "docs/trace-schema.md"])
def test_readme_names(name):
    assert f"`{name}" in README or f"({name})" in README
    if "/" in name:
        assert (ROOT / name).is_file()


def test_the_smoke_time_claim_is_the_measured_one_everywhere():
    # measured with `time python -m pytest -q -m smoke` on a shared 2-core machine (2026-12-05): 560 tests, 223 s
    # of CPU (user + sys); the three places say the same figures
    for path in ("README.md", "tox.ini", "docs/hardware-profiling.md"):
        text = " ".join((ROOT / path).read_text().split())
        assert "under a minute" not in text and "223 s" in text and "about 560 tests" in text, path
