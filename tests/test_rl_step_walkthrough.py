"""The RL-step walkthrough's parts (issue 35): examples/trl_grpo_phases.py's shapes, and tools/rl_step_compare.py,
the comparison tools/rl_step_walkthrough.sh runs on the H200 (the analyzer's phases.csv / steps.csv against
`nsys stats` / `nsys analyze` on the same export), here on the committed TRL capture."""
from __future__ import annotations

import csv
import importlib.util
import pathlib
import subprocess
import sys

import pytest

from tests.nsys_reference import DATA

ROOT = pathlib.Path(__file__).resolve().parent.parent
TRL = DATA / "capture_trl"


def example():
    spec = importlib.util.spec_from_file_location("trl_grpo_phases", ROOT / "examples" / "trl_grpo_phases.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_qwen_shape_is_qwen2_5_0_5b_and_every_id_decodes():
    for mod in ("transformers", "datasets", "trl"):  # the example's imports (tox -e trl runs this file)
        pytest.importorskip(mod)
    import torch

    ex = example()
    mods = ex.imports()
    fast, config = ex.tokenizer_and_config("qwen2.5-0.5b", mods)
    assert len(fast) == config.vocab_size == 151936 and config.tie_word_embeddings
    with torch.device("meta"):  # the shape alone: no memory, no init
        model = mods[2].Qwen2ForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == 494_032_768  # Qwen2.5-0.5B's parameter count
    assert fast("hello grpo")["input_ids"] == [fast.convert_tokens_to_ids(c) for c in "hello grpo"]
    ids = torch.randint(3, config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0)).tolist()
    for row, text in zip(ids, fast.batch_decode(ids, skip_special_tokens=True), strict=True):
        assert text and "<unk>" not in text, row
    tiny, tiny_config = ex.tokenizer_and_config("tiny", mods)
    assert len(tiny) == tiny_config.vocab_size == 30 and tiny_config.num_hidden_layers == 2


def test_bad_shape_or_head_is_a_usage_error(capsys):
    ex = example()
    assert ex.main(["--shape", "qwen3"]) == 2
    assert "invalid choice: 'qwen3'" in capsys.readouterr().err
    assert ex.main(["--head", "liger"]) == 2


def compare(tmp_path, report):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "rl_step_compare.py"), str(report), str(TRL),
                           str(TRL / "trace.sqlite")], capture_output=True, text=True, timeout=300)


@pytest.fixture
def trl_report(tmp_path):
    pytest.importorskip("duckdb")
    if not (TRL / "trace.sqlite").is_file():
        pytest.skip("no tests/data/capture_trl")
    report = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "pipelines.analyze", str(TRL), "--out", str(report)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return report


def test_compare_passes_on_the_trl_capture_and_names_a_difference(tmp_path, trl_report):
    proc = compare(tmp_path, trl_report)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1] == "rl_step_compare.py: equal to NVIDIA on trace.sqlite (8 phases, 1 steps)"
    assert "rollout                 1/1       843.61/843.61 " in proc.stdout  # ours beside nvtx_sum's
    # one GPU op more in one phase than nvtx_gpu_proj_sum counts: exit 1 naming the range
    path = trl_report / "phases.csv"
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    rows[1]["gpu_ops"] = str(int(rows[1]["gpu_ops"]) + 1)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    proc = compare(tmp_path, trl_report)
    assert proc.returncode == 1
    assert proc.stdout.splitlines()[-1] == ("rl_step_compare.py: NOT equal to NVIDIA on trace.sqlite: "
                                            "rlkernel:phase:rollout")


def test_compare_without_a_phase_view_exits_2(tmp_path):
    (tmp_path / "report").mkdir()
    proc = compare(tmp_path, tmp_path / "report")
    assert proc.returncode == 2 and "phases.csv: no such file" in proc.stderr
