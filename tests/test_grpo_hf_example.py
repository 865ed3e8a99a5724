"""examples/grpo_hf.py run tiny on the CPU: the losses of the model's own logits path and rlkernel.linear_logp_loss
agree within the bound the example prints, it exits 0, writes a manifest the analyzer reads, answers --help, and
exits 3 with an install hint when transformers is missing (the GPU node runs it at full size: .gpu/issue21b.sh)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import grpo_hf  # noqa: E402

TINY = ["--device", "cpu", "--hidden-size", "32", "--intermediate-size", "48", "--layers", "2", "--heads", "4",
        "--kv-heads", "2", "--vocab-size", "257", "--prompts", "2", "--samples", "3", "--prompt-len", "5",
        "--new-tokens", "11", "--steps", "2", "--chunk-size", "8", "--lr", "1e-2"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_run_agrees_within_its_bound_and_writes_a_manifest(tmp_path, capsys, dtype):
    pytest.importorskip("transformers")
    from pipelines.manifest import manifest_problem

    manifest = tmp_path / "manifest.json"
    assert grpo_hf.main([*TINY, "--dtype", dtype, "--manifest", str(manifest)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ")]
    assert len(lines) == 2
    for ln in lines:
        diff, bound = map(float, re.search(r"\|diff\| (\S+)  bound (\S+) ok", ln).groups())
        assert diff <= bound
        assert "linear_logp_loss fallback" in ln  # CPU: the native path, recorded as a fallback of "auto"
    data = json.loads(manifest.read_text())
    assert manifest_problem(data) is None
    assert data["workloads"][0]["name"] == grpo_hf.WORKLOAD
    assert data["workloads"][0]["fused_ops"] == ["linear_logp_loss"]
    assert any(r["op"] == "linear_logp_loss" for r in data["dispatch"])


def test_the_bound_catches_a_wrong_temperature(capsys):
    """A check that can fail: the rlkernel path at another temperature than the reference's exceeds the bound."""
    pytest.importorskip("transformers")
    real = grpo_hf.rlkernel_step

    def hotter(model, ids, comp, keep, adv, old, args):
        args2 = type(args)(**{**vars(args), "temperature": args.temperature * 1.3})
        return real(model, ids, comp, keep, adv, old, args2)

    grpo_hf.rlkernel_step = hotter
    try:
        assert grpo_hf.main([*TINY, "--steps", "1", "--entropy-coef", "0.5"]) == 1
    finally:
        grpo_hf.rlkernel_step = real
    captured = capsys.readouterr()
    assert "EXCEEDED" in captured.out and "beyond the bound" in captured.err


def test_missing_transformers_exits_3_with_the_install_hint(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    assert grpo_hf.main(TINY) == 3
    err = capsys.readouterr().err
    assert "transformers is not installed" in err and "rlkernel[hf]" in err


@pytest.mark.parametrize("bad", [["--samples", "1"], ["--heads", "3"], ["--temperature", "0"], ["--chunk-size", "0"],
                                 ["--require-fused", "--backend", "native"], ["--no-such-flag"]])
def test_bad_usage_exits_2(bad, capsys):
    assert grpo_hf.main([*TINY, *bad]) == 2
    assert capsys.readouterr().err.startswith("grpo_hf: ")


def test_help_is_true_and_exits_0():
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "grpo_hf.py"), "--help"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0
    for flag in ("--new-tokens", "--entropy-coef", "--temperature", "--manifest", "--require-fused"):
        assert flag in r.stdout
    assert "151936" in r.stdout and "896" in r.stdout
