"""Each CLI names the command the user typed (issue 40): a console script its own name, ``python -m`` the module,
in the usage line and in its error lines. The console scripts are stood in for by wrapper scripts of the same name
on PATH, as pip writes them (``sys.exit(main())`` from a file named after the script)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlkernel.cli import message_prefix, prog_name
from tests.subprocess_env import pythonpath

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = {"rlkernel-analyze": "pipelines.analyze", "rlkernel-capture": "pipelines.capture",
           "rlkernel-profile": "rlkernel.profiling.cli", "rlkernel-build": "rlkernel.build"}


@pytest.fixture(scope="module")
def bin_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("bin")
    for script, module in SCRIPTS.items():
        (d / script).write_text(f"#!{sys.executable}\nimport sys\nfrom {module} import main\nsys.exit(main())\n")
        (d / script).chmod(0o755)
    return d


def _run(bin_dir, *cmd):
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=pythonpath())
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=120, env=env, cwd=bin_dir)


def test_prog_name_forms():
    assert prog_name("pipelines.analyze", "/venv/bin/rlkernel-analyze") == "rlkernel-analyze"
    assert prog_name("rlkernel.profiling", "scripts/run_profile_suite.py") == "run_profile_suite.py"
    assert prog_name("pipelines.analyze", str(ROOT / "pipelines" / "analyze.py")) == "python -m pipelines.analyze"
    main = ROOT / "rlkernel" / "profiling" / "__main__.py"
    assert prog_name("rlkernel.profiling.cli", str(main)) == "python -m rlkernel.profiling"
    assert prog_name("pipelines.capture", "-c") == prog_name("pipelines.capture", None) == "python -m pipelines.capture"
    assert message_prefix("python -m pipelines.capture") == "pipelines.capture"
    assert message_prefix("rlkernel-capture") == "rlkernel-capture"


def test_console_scripts_name_themselves_in_usage_and_errors(bin_dir):
    for script in ("rlkernel-analyze", "rlkernel-capture", "rlkernel-build"):
        bad = _run(bin_dir, script, "--bogus")
        assert bad.returncode == 2
        assert bad.stderr.strip().splitlines() == [f"{script}: unrecognized arguments: --bogus (see --help)"]
    helped = _run(bin_dir, "rlkernel-capture", "--help")
    assert helped.returncode == 0 and helped.stdout.startswith("usage: rlkernel-capture ["), helped.stdout[:200]
    assert "python -m pipelines.capture" not in helped.stdout


def test_profile_script_names_itself(bin_dir):
    helped = _run(bin_dir, "rlkernel-profile", "--help")
    assert helped.returncode == 0 and helped.stdout.startswith("usage: rlkernel-profile ["), helped.stdout[:200]
    assert "run_profile_suite.py" not in helped.stdout.split("\n\n", 1)[0]
    bad = _run(bin_dir, "rlkernel-profile", "--batch-sizes", "x")
    assert bad.returncode == 2 and bad.stderr.startswith("rlkernel-profile: argument --batch-sizes"), bad.stderr


def test_python_m_names_the_module(bin_dir):
    bad = _run(bin_dir, sys.executable, "-m", "pipelines.analyze", "--bogus")
    assert bad.stderr.strip().splitlines() == ["pipelines.analyze: unrecognized arguments: --bogus (see --help)"]
    helped = _run(bin_dir, sys.executable, "-m", "pipelines.analyze", "--help")
    assert helped.stdout.startswith("usage: python -m pipelines.analyze [")
    bad = _run(bin_dir, sys.executable, "-m", "rlkernel.build", "--bogus")
    assert bad.stderr.strip().splitlines() == ["rlkernel.build: unrecognized arguments: --bogus (see --help)"]
