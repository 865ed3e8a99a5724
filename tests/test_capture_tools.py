"""Finding nsys/ncu (search order, versions) and the .qdstrm-only diagnosis, with fake tools on temporary paths."""
import os
import stat

import pytest

from pipelines import tools
from rlkernel.cli import EXIT_BLOCKED, EXIT_USAGE, CliError

pytestmark = pytest.mark.smoke

NSYS_VERSION = "NVIDIA Nsight Systems version 2025.3.1.90-253135822789v0"
NCU_VERSION = ("NVIDIA (R) Nsight Compute Command Line Profiler\nCopyright (c) 2018-2025 NVIDIA Corporation\n"
               "Version 2025.3.1.0 (build 36398880) (public-release)")


def fake_tool(path, version_text):
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join(f"echo '{ln}'\n" for ln in version_text.splitlines())  # shell builtins only: PATH may be empty
    path.write_text(f"#!/bin/sh\n{lines}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_parse_versions_of_real_outputs():
    assert tools.parse_version("nsys", NSYS_VERSION) == "2025.3.1.90-253135822789v0"
    assert tools.parse_version("ncu", NCU_VERSION) == "2025.3.1.0"


def test_search_order(tmp_path):
    opt = tmp_path / "opt"
    bundled_old = fake_tool(opt / "nsight-compute/2024.1.0/host/target-linux-x64/nsys", "x version 2024.1")
    bundled_new = fake_tool(opt / "nsight-compute/2025.3.1/host/target-linux-x64/nsys", "x version 2025.3")
    env = {"PATH": str(tmp_path / "empty")}
    # the bundled copy is the last resort, newest version first
    t = tools.find("nsys", environ=env, opt_root=str(opt))
    assert (t.path, t.version, t.source) == (bundled_new, "2025.3", "nsys bundled with Nsight Compute")
    assert [p for p, _ in tools.candidates("nsys", None, env, str(opt))] == [bundled_new, bundled_old]
    standalone = fake_tool(opt / "nsight-systems/2025.1.1/bin/nsys", "x version 2025.1")
    assert tools.find("nsys", environ=env, opt_root=str(opt)).path == standalone
    cuda_home = fake_tool(tmp_path / "cuda/bin/nsys", "x version cuda")
    env["CUDA_HOME"] = str(tmp_path / "cuda")
    assert tools.find("nsys", environ=env, opt_root=str(opt)).path == cuda_home
    on_path = fake_tool(tmp_path / "bin/nsys", "x version path")
    env["PATH"] = str(tmp_path / "bin")
    assert tools.find("nsys", environ=env, opt_root=str(opt)).source == "PATH"
    assert tools.find("nsys", environ=env, opt_root=str(opt)).path == on_path
    from_env = fake_tool(tmp_path / "env/nsys", "x version env")
    env["NSYS"] = from_env
    assert tools.find("nsys", environ=env, opt_root=str(opt)).source == "$NSYS"
    flag = fake_tool(tmp_path / "flag/nsys", "x version flag")
    t = tools.find("nsys", flag, environ=env, opt_root=str(opt))
    assert (t.path, t.version, t.source) == (flag, "flag", "--nsys")


def test_ncu_found_in_its_install_root(tmp_path):
    ncu = fake_tool(tmp_path / "opt/nsight-compute/2025.3.1/ncu", NCU_VERSION)
    t = tools.find("ncu", environ={"PATH": ""}, opt_root=str(tmp_path / "opt"))
    assert (t.path, t.version) == (ncu, "2025.3.1.0")
    assert t.record() == {"path": ncu, "version": "2025.3.1.0", "source": "nsight-compute install"}


def test_bad_flag_is_usage_bad_env_and_none_are_blocked(tmp_path):
    with pytest.raises(CliError) as e:
        tools.find("nsys", str(tmp_path / "nope"), environ={"PATH": ""}, opt_root=str(tmp_path))
    assert e.value.code == EXIT_USAGE
    with pytest.raises(CliError) as e:
        tools.find("nsys", environ={"PATH": "", "NSYS": str(tmp_path / "nope")}, opt_root=str(tmp_path))
    assert e.value.code == EXIT_BLOCKED and "$NSYS" in str(e.value)
    with pytest.raises(CliError) as e:
        tools.find("nsys", environ={"PATH": ""}, opt_root=str(tmp_path))
    assert e.value.code == EXIT_BLOCKED
    assert "install Nsight Systems or pass --nsys PATH" in str(e.value) and "node-kit" not in str(e.value)
    assert "\n" not in str(e.value)


def test_tool_whose_version_fails_is_blocked(tmp_path):
    bad = tmp_path / "nsys"
    bad.write_text("#!/bin/sh\necho 'libfoo.so: cannot open shared object file' >&2\nexit 127\n")
    bad.chmod(0o755)
    with pytest.raises(CliError) as e:
        tools.find("nsys", str(bad), environ={"PATH": ""})
    assert e.value.code == EXIT_BLOCKED and "libfoo.so" in str(e.value)


def test_missing_libraries_from_ldd_output():
    ldd = ("\tlinux-vdso.so.1 (0x00007ffd)\n\tlibdw.so.1 => not found\n"
           "\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f)\n\tlibelf.so.1 => not found\n")
    assert tools.missing_libraries(ldd) == ["libdw.so.1", "libelf.so.1"]


def test_qdstrm_diagnosis_names_the_importer_and_the_fix(tmp_path):
    # the layout of the nsys bundled with Nsight Compute: the importer sits in a sibling host folder
    host = tmp_path / "nsight-compute/2025.3.1/host"
    nsys = fake_tool(host / "target-linux-x64/nsys", NSYS_VERSION)
    importer = host / "linux-desktop-glibc_2_11_3-x64/QdstrmImporter"
    importer.parent.mkdir(parents=True)
    importer.write_text("#!/bin/sh\n")
    assert tools.importer_paths(nsys) == [str(importer)]
    msg = tools.diagnose_qdstrm(nsys, str(tmp_path / "trace.qdstrm"))
    assert "only trace.qdstrm" in msg and str(importer) in msg
    assert "libdw.so.1" in msg and "apt-get install libdw1" in msg and "node-kit" not in msg and "\n" not in msg
    assert os.path.basename(nsys) == "nsys"
