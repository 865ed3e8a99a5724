"""Every script under tools/ answers --help with its help, exit 0, and does nothing else (issue 19 item 24).

Each runs from a copy of tools/ (so a folder it would create, e.g. reports/ beside tools/, shows), with a private
TMPDIR and HOME, and with the programs the scripts drive (nvcc, nsys, ncu, nvidia-smi, g++) replaced on PATH by
stand-ins that leave a mark: a build, a capture or a probe of the GPU started by --help shows as a mark.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.subprocess_env import pythonpath

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p.relative_to(ROOT) for p in (ROOT / "tools").rglob("*")
                 if p.suffix in (".sh", ".py") and not p.name.startswith("_"))  # _tricky.py: a module, not a script
DRIVEN = ("nvcc", "nsys", "ncu", "nvidia-smi", "g++")


def _tree(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


@pytest.mark.smoke
@pytest.mark.parametrize("script", SCRIPTS, ids=str)
def test_help_prints_help_and_does_nothing_else(tmp_path, script):
    tree, tmp, home, marks, fakes = (tmp_path / d for d in ("tree", "tmp", "home", "marks", "bin"))
    shutil.copytree(ROOT / "tools", tree / "tools", ignore=shutil.ignore_patterns("__pycache__"))
    for d in (tmp, home, marks, fakes):
        d.mkdir()
    for name in DRIVEN:
        fake = fakes / name
        fake.write_text(f"#!/bin/sh\ntouch '{marks}/{name}'\nexit 0\n")
        fake.chmod(0o755)
    before = _tree(tree)
    python = str(Path(sys.executable).parent)
    env = {"PATH": os.pathsep.join([str(fakes), python, "/usr/bin", "/bin"]), "TMPDIR": str(tmp), "HOME": str(home),
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHON": sys.executable,
           # the project's package, as an install provides it (the copy holds tools/ only), and what else is on the
           # path (a GPU node kit's packages)
           "PYTHONPATH": pythonpath()}
    cmd = ["bash"] if script.suffix == ".sh" else [sys.executable]
    out = subprocess.run([*cmd, str(tree / script), "--help"], capture_output=True, text=True, cwd=tree, env=env,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stderr == "" and script.name in out.stdout and len(out.stdout.splitlines()) >= 2, out
    assert _tree(tree) == before and list(tmp.iterdir()) == [] and list(home.iterdir()) == []
    assert list(marks.iterdir()) == []


@pytest.mark.smoke
@pytest.mark.parametrize("stages", [["bogus"], ["node", "bogus"]], ids=" ".join)
def test_gpu_check_unknown_stage_before_anything(tmp_path, stages):
    # it made its folders (and ran the stages before the unknown one) and then said "unknown stage"
    tree, tmp = tmp_path / "tree", tmp_path / "tmp"
    shutil.copytree(ROOT / "tools", tree / "tools", ignore=shutil.ignore_patterns("__pycache__"))
    tmp.mkdir()
    before = _tree(tree)
    env = {"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp), "HOME": str(tmp_path)}
    out = subprocess.run(["bash", str(tree / "tools" / "gpu_check.sh"), *stages], capture_output=True, text=True,
                         cwd=tree, env=env, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == ["gpu_check: unknown stage bogus (known: node build tests profile grpo "
                                               "capture bench example; see --help)"]
    assert _tree(tree) == before and list(tmp.iterdir()) == []


def test_gpu_check_with_every_gpu_hidden_exits_3_and_leaves_no_scratch(tmp_path):
    # CUDA_VISIBLE_DEVICES set but empty stays empty (it once became GPU 0); the GPU selection is then blocked on any
    # machine, and a run that proved nothing exits 3, not 0; the script's scratch folder is removed
    tmp, out_dir = tmp_path / "tmp", tmp_path / "out"
    tmp.mkdir()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TMPDIR": str(tmp), "OUT": str(out_dir),
           "PYTHON": sys.executable, "PYTHONPATH": pythonpath()}
    out = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "node"], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=300)
    summary = (out_dir / "summary.txt").read_text()
    assert out.returncode == 3, out.stdout[-2000:] + out.stderr[-2000:]
    assert "CUDA_VISIBLE_DEVICES=)" in summary and "select-gpu         blocked" in summary
    assert list(tmp.iterdir()) == []


@pytest.mark.smoke
@pytest.mark.parametrize("args, words", [
    ([], "give OLD_COMMIT NEW_COMMIT (see --help)"),
    (["HEAD"], "give OLD_COMMIT NEW_COMMIT (see --help)"),
    (["no-such-commit", "HEAD"], "no-such-commit: not a commit of "),
], ids=["none", "one", "unknown-commit"])
def test_compare_outputs_bad_usage_exits_2_before_anything(tmp_path, args, words):
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--git-dir"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: compare_outputs.sh compares commits")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = subprocess.run(["bash", str(ROOT / "tools" / "compare_outputs.sh"), *args], capture_output=True, text=True,
                         cwd=tmp_path, env={**os.environ, "TMPDIR": str(tmp)}, timeout=60)
    assert out.returncode == 2 and out.stdout == "", out
    assert out.stderr.startswith(f"compare_outputs.sh: {words}") and out.stderr.count("\n") == 1, out.stderr
    assert list(tmp.iterdir()) == []
