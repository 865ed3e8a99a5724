"""The installed package (issue 19 item 29): build the wheel from a copy of the tree, install it into a fresh venv,
and run the console scripts and ``python -m pipelines.analyze`` from a folder outside the repository.

No network: the wheel is built by the running interpreter's setuptools when it has one (as ``pip install -e .``
would), else by pip's isolated build from the configured index (as tox's own install of the package is), and
installed with ``--no-deps --no-index``. The venv sees the running environment's packages (torch, duckdb, ...) by a
``.pth`` line placed after its own site-packages, so the package it imports is the installed wheel's (checked).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COPY_IGNORE = shutil.ignore_patterns(".git", ".tox", "build", "dist", "*.egg-info", "reports", "runs", "__pycache__",
                                     ".pytest_cache", ".ruff_cache", ".node-kit", ".whl", "*.so")
SCRIPTS = ("rlkernel-capture", "rlkernel-analyze", "rlkernel-profile")


def _builds_wheels_here() -> bool:
    """This interpreter's setuptools can build the wheel: setuptools 70.1 has bdist_wheel, older needs `wheel`."""
    if importlib.util.find_spec("setuptools") is None:
        return False
    import setuptools

    major, minor = (int(x) for x in setuptools.__version__.split(".")[:2])
    return (major, minor) >= (70, 1) or importlib.util.find_spec("wheel") is not None


def _run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("packaging")
    shutil.copytree(ROOT, tmp / "src", ignore=COPY_IGNORE)
    no_isolation = ["--no-build-isolation"] if _builds_wheels_here() else []
    # the wheel's contents and scripts, not its compiled extension: on a GPU node pip would otherwise compile every
    # kernel here (minutes, beside the suite's other workers); the GPU install has its own check
    # (tools/gpu_install_check.sh), and the extension left out is setup.py's RLKERNEL_BUILD_EXT=0 wheel
    no_ext = {**os.environ, "RLKERNEL_BUILD_EXT": "0"}
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", *no_isolation, "-w", str(tmp / "dist"),
                  str(tmp / "src")], env=no_ext)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp / "dist").glob("rlkernel-*.whl")
    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    purelib = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip())
    inst = _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", str(wheel)])
    assert inst.returncode == 0, inst.stdout + inst.stderr
    # only now: pip must not find the running environment's own rlkernel (tox installs one) already satisfying it
    # (and the PYTHONPATH entries that are not this repository: a GPU node kit puts duckdb and nvtx there)
    kit = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
           if p and Path(p).resolve() != Path(__file__).resolve().parents[1]]
    outer = dict.fromkeys([*site.getsitepackages(), sysconfig.get_path("purelib"), sysconfig.get_path("platlib"),
                           *kit])
    (purelib / "zz_outer_env.pth").write_text("".join(f"{p}\n" for p in outer))  # after the venv's own packages
    outside = tmp / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env['PATH']}"
    return {"wheel": wheel, "py": py, "bin": env_dir / "bin", "purelib": purelib, "cwd": outside, "env": env,
            "src": tmp / "src"}


def _in(installed, *cmd):
    return _run([str(c) for c in cmd], cwd=installed["cwd"], env=installed["env"])


def test_wheel_ships_sql_and_templates_inside_pipelines(installed):
    names = zipfile.ZipFile(installed["wheel"]).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"rlkernel", "pipelines"}  # no generic top-level `queries` or `reports_templates`
    for folder, pattern in (("queries", "*.sql"), ("reports_templates", "*.j2")):
        shipped = sorted(n for n in names if n.startswith(f"pipelines/{folder}/"))
        assert shipped == sorted(f"pipelines/{folder}/{p.name}" for p in (ROOT / folder).glob(pattern)) != []
    # every package of the tree is in the wheel
    packages = {str(p.parent.relative_to(ROOT)) for top in ("rlkernel", "pipelines")
                for p in (ROOT / top).rglob("__init__.py")}
    assert {p for p in packages if f"{p}/__init__.py" not in names} == set()


def test_wheel_declares_the_licence_as_spdx_and_ships_its_text(installed):
    wheel = zipfile.ZipFile(installed["wheel"])
    (metadata,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    lines = wheel.read(metadata).decode().splitlines()
    assert "License-Expression: Apache-2.0" in lines  # PEP 639, not the deprecated License: table form
    licences = [n for n in wheel.namelist() if ".dist-info/licenses/" in n]
    assert [n.rsplit("/", 1)[1] for n in licences] == ["LICENSE"]
    assert b"Apache License" in wheel.read(licences[0]) and b"Version 2.0, January 2004" in wheel.read(licences[0])


def test_imports_come_from_the_install(installed):
    out = _in(installed, installed["py"], "-c", "import pipelines, rlkernel; print(pipelines.__file__); "
              "print(rlkernel.__file__)")
    assert out.returncode == 0, out.stderr
    assert all(Path(p).is_relative_to(installed["purelib"]) for p in out.stdout.split()), out.stdout


@pytest.mark.parametrize("script, module, words", [
    ("rlkernel-capture", "pipelines.capture", "--require-fused"),
    ("rlkernel-analyze", "pipelines.analyze", "--compare"),
    ("rlkernel-profile", "rlkernel.profiling", "--smoke"),
    ("rlkernel-build", "rlkernel.build", "--arch"),
])
def test_console_scripts_are_the_python_m_clis(installed, script, module, words):
    by_script = _in(installed, installed["bin"] / script, "--help")
    by_module = _in(installed, installed["py"], "-m", module, "--help")
    assert by_script.returncode == by_module.returncode == 0, by_script.stderr + by_module.stderr
    # each names the command as typed (the usage block's wrapping follows the name's length); the rest is one text
    assert by_script.stdout.startswith(f"usage: {script} [") and words in by_script.stdout
    assert by_module.stdout.startswith(f"usage: python -m {module} [")
    assert _after_usage(by_script.stdout).replace(script, f"python -m {module}") == _after_usage(by_module.stdout)
    if module == "rlkernel.profiling":  # the module the suite lives in says the same (it printed nothing)
        by_cli = _in(installed, installed["py"], "-m", "rlkernel.profiling.cli", "--help").stdout
        assert by_cli.startswith("usage: python -m rlkernel.profiling.cli [")
        assert _after_usage(by_cli) == _after_usage(by_module.stdout)
    bad = _in(installed, installed["bin"] / script, "--no-such-flag")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith(f"{script}: unrecognized arguments: --no-such-flag")


def _after_usage(help_text: str) -> str:
    return help_text.split("\n\n", 1)[1]


def test_analyze_the_bundled_example_from_outside_the_repository(installed):
    # another distribution's top-level `queries` beside pipelines is not the analyzer's
    for name, file in (("queries", "stage_gpu_ops.sql"), ("reports_templates", "report.html.j2")):
        (installed["purelib"] / name).mkdir(exist_ok=True)
        (installed["purelib"] / name / file).write_text("not the analyzer's {{")
    out = _in(installed, installed["py"], "-m", "pipelines.analyze")
    assert out.returncode == 0, out.stderr
    report = installed["cwd"] / "reports" / "example"
    assert (report / "report.html").stat().st_size > 0 and (report / "kernel_summary.csv").is_file()


def test_profile_suite_runs_from_the_install(installed):
    out = _in(installed, installed["bin"] / "rlkernel-profile", "--device", "cpu", "--smoke", "--workloads",
              "logp-native", "--output-dir", "profile")
    assert out.returncode == 0, out.stderr
    assert sorted(p.suffix for p in (installed["cwd"] / "profile").iterdir()) == [".csv", ".json"]


def test_sdist_and_wheel_ship_every_csrc_file_the_build_needs(installed, tmp_path):
    # issue 30: the first fused call builds rlkernel._C from the sources inside the package; every file under csrc/
    # is what the build compiles, includes and hashes into its cache key
    from rlkernel import _jit

    needed = _jit.source_files(ROOT / "csrc")
    assert any(f.endswith(".cu") for f in needed) and any(f.startswith("include/rlkernel/") for f in needed)
    wheel = set(zipfile.ZipFile(installed["wheel"]).namelist())
    assert [f for f in needed if f"rlkernel/csrc/{f}" not in wheel] == []
    sdist_py = f"from setuptools import build_meta as b; print(b.build_sdist({str(tmp_path)!r}))"
    made = _run([sys.executable, "-c", sdist_py], cwd=installed["src"])
    assert made.returncode == 0, made.stderr
    (sdist,) = tmp_path.glob("rlkernel-*.tar.gz")
    import tarfile

    with tarfile.open(sdist) as tar:
        names = set(tar.getnames())
    top = sdist.name.removesuffix(".tar.gz")
    assert [f for f in needed if f"{top}/csrc/{f}" not in names] == []
    # the install builds from its own copy, and hashes it as the checkout does: the same cache key
    out = _in(installed, installed["py"], "-c", "from rlkernel import _ext, _jit; d = _ext.csrc_dir(); "
              "print(d); print(_jit.sources_hash(d))")
    assert out.returncode == 0, out.stderr
    where, digest = out.stdout.split()
    assert Path(where) == installed["purelib"] / "rlkernel" / "csrc" and digest == _jit.sources_hash(ROOT / "csrc")
