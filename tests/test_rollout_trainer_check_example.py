"""examples/rollout_trainer_check.py run small on the CPU: the batch-invariant row is exactly 1 (exit 0), the
unfiltered row shows the extra log S, a failed bitwise check exits 1, and usage errors exit 2 (the H200 run at
N=16384, H=4096, V=128256 is the lead's)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import rollout_trainer_check as check  # noqa: E402

SMALL = ["--device", "cpu", "--n", "96", "--hidden", "32", "--vocab", "300"]


def _rows(out):
    return {ln.split()[0]: ln.split() for ln in out.splitlines() if ln.split() and ln.split()[0] in
            ("bf16", "float32", "batch_invariant", "unfiltered")}


def test_small_cpu_run_is_exact_when_batch_invariant(capsys):
    assert check.main(SMALL) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert set(rows) == {"bf16", "float32", "batch_invariant", "unfiltered"}
    bi = rows["batch_invariant"]
    assert float(bi[1]) == 0 and bi[-3:] == ["0", "0", "0"]  # max |dlog|, kept changes, rows, dropped
    assert float(rows["unfiltered"][6]) < 0.99  # mean ratio: the full-vocabulary log-prob misses log S
    assert re.search(r"ratio exactly 1 for all 96 tokens", out)


def test_a_broken_batch_invariant_path_exits_1(monkeypatch, capsys):
    real = check.rlkernel.linear_logp

    def off_by_a_bit(*args, **kwargs):
        out = real(*args, **kwargs)
        return out + 1e-3 if kwargs.get("batch_invariant") else out

    monkeypatch.setattr(check.rlkernel, "linear_logp", off_by_a_bit)
    assert check.main(SMALL) == 1
    assert "not bitwise" in capsys.readouterr().err


def test_usage_errors_exit_2(capsys):
    assert check.main(["--n", "x"]) == 2
    assert "invalid int value" in capsys.readouterr().err
