"""tools/traces/strip_export.py, which makes committed fixtures: environment out, paths and host scrubbed."""
from __future__ import annotations

import importlib.util
import json
import pathlib
import socket
import sqlite3
import subprocess
import sys

import pytest

pytestmark = pytest.mark.smoke
TOOL = pathlib.Path(__file__).resolve().parent.parent / "tools" / "traces" / "strip_export.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("strip_export", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_strip_removes_environment_and_scrubs_paths(tmp_path):
    src, dst = tmp_path / "src.sqlite", tmp_path / "dst.sqlite"
    work = str(tmp_path / "work")
    host = socket.gethostname()
    con = sqlite3.connect(src)
    con.execute("CREATE TABLE TARGET_INFO_SYSTEM_ENV (globalVid INTEGER, name TEXT, value TEXT)")
    con.execute("INSERT INTO TARGET_INFO_SYSTEM_ENV VALUES (1, 'HF_TOKEN', 'hf_secret')")
    con.execute("CREATE TABLE META_DATA_CAPTURE (name TEXT, value TEXT)")
    con.executemany("INSERT INTO META_DATA_CAPTURE VALUES (?, ?)", [
        ("PROCESS_0:ENVIRONMENT_VARIABLE", "HF_TOKEN=\"hf_secret\""),
        ("PROCESS_0:WORKING_DIR", work), ("DEVICE_DISPLAY_NAME", host)])
    con.execute("CREATE TABLE META_DATA_EXPORT (name TEXT, value TEXT)")
    con.execute("INSERT INTO META_DATA_EXPORT VALUES ('EXPORT_PARAM_INPUT_PATH', ?)", (work + "/x.nsys-rep",))
    con.commit()
    con.close()
    load_tool().strip(str(src), str(dst), [work])
    con = sqlite3.connect(dst)
    dump = "\n".join(con.iterdump())
    assert "hf_secret" not in dump and work not in dump and host not in dump
    assert con.execute("SELECT value FROM META_DATA_EXPORT").fetchone()[0] == "<path>/x.nsys-rep"
    assert con.execute("SELECT count(*) FROM META_DATA_CAPTURE").fetchone()[0] == 2  # only the env row went
    # The source export is left as nsys wrote it.
    assert sqlite3.connect(src).execute("SELECT count(*) FROM TARGET_INFO_SYSTEM_ENV").fetchone()[0] == 1


def test_strip_blanks_environment_strings_in_the_string_table(tmp_path):
    # nsys also interns the launched process's NAME=value strings in StringIds
    src, dst = tmp_path / "src.sqlite", tmp_path / "dst.sqlite"
    con = sqlite3.connect(src)
    con.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL)")
    con.executemany("INSERT INTO StringIds VALUES (?, ?)", [(1, "HF_TOKEN=hf_secret"), (2, "op.logp.forward"),
                                                            (3, "void f<a = 1>(int)")])
    con.commit()
    con.close()
    load_tool().strip(str(src), str(dst), [])
    rows = dict(sqlite3.connect(dst).execute("SELECT id, value FROM StringIds"))
    assert rows == {1: "", 2: "op.logp.forward", 3: "void f<a = 1>(int)"}


ABSOLUTE = ("/opt/", "/tmp/", "/usr/", "/root/", "/work/", "/home/")


def test_strip_scrubs_absolute_paths_in_every_text_column(tmp_path):
    src, dst = tmp_path / "src.sqlite", tmp_path / "it's a copy.sqlite"  # a quote in the name: VACUUM INTO binds
    kernel = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>(int, T1, T2)"
    con = sqlite3.connect(src)
    con.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL)")
    con.executemany("INSERT INTO StringIds VALUES (?, ?)", [
        (1, kernel), (2, "op.logp.forward"), (3, "kworker/0:1-mm_percpu_wq"),
        (4, "Loaded CUPTI library: /opt/nvidia/nsight-compute/2025.3.1/host/libcupti.so.13.0"),
        (5, "see /tmp/nvidia/nsight_systems/quadd_session_1/streams/pid_7_stdout.log and stderr.log"),
        (6, "a/b relative stays")])
    con.execute("CREATE TABLE PROCESSES (globalPid INTEGER, pid INTEGER, name)")  # no declared type
    con.execute("INSERT INTO PROCESSES VALUES (1, 7, '/opt/torch/.venv/bin/python3')")
    con.execute("CREATE TABLE ANALYSIS_FILE (id INTEGER, filename TEXT)")
    con.execute("INSERT INTO ANALYSIS_FILE VALUES (1, '/tmp/nvidia/nsight_systems/quadd_session_1/x.log')")
    con.execute("CREATE TABLE META_DATA_CAPTURE (name TEXT, value TEXT)")
    con.executemany("INSERT INTO META_DATA_CAPTURE VALUES (?, ?)", [
        ("PROCESS_0:COMMAND", "/opt/torch/.venv/bin/python3"), ("PROCESS_0:ARGS", "-m x --out=/root/y/z.json"),
        ("PROCESS_0:ENVIRONMENT_VARIABLES", "HOME=/root")])
    con.commit()
    con.close()
    load_tool().strip(str(src), str(dst), [])
    con = sqlite3.connect(dst)
    strings = dict(con.execute("SELECT id, value FROM StringIds"))
    assert strings == {1: kernel, 2: "op.logp.forward", 3: "kworker/0:1-mm_percpu_wq",
                       4: "Loaded CUPTI library: <path>/libcupti.so.13.0",
                       5: "see <path>/pid_7_stdout.log and stderr.log", 6: "a/b relative stays"}
    assert con.execute("SELECT name FROM PROCESSES").fetchone()[0] == "<path>/python3"
    assert con.execute("SELECT filename FROM ANALYSIS_FILE").fetchone()[0] == "<path>/x.log"
    assert dict(con.execute("SELECT name, value FROM META_DATA_CAPTURE")) == {
        "PROCESS_0:COMMAND": "<path>/python3", "PROCESS_0:ARGS": "-m x --out=<path>/z.json"}
    assert not any(a in line for line in con.iterdump() for a in ABSOLUTE)


def test_strip_refuses_to_overwrite_its_source(tmp_path):
    src = tmp_path / "t.sqlite"
    sqlite3.connect(src).execute("CREATE TABLE t (x TEXT)").connection.commit()
    with pytest.raises(ValueError, match="same file"):
        load_tool().strip(str(src), str(tmp_path / "." / "t.sqlite"), [])
    assert src.stat().st_size > 0  # not deleted first


def _cli(*args, cwd):
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def test_cli_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path):
    """A missing or non-SQLite source, a missing or directory destination, an unknown flag: one line, exit 2, no
    file created (sqlite3.connect would create a missing source) and an existing destination left as it was."""
    keep = tmp_path / "keep.sqlite"
    sqlite3.connect(keep).execute("CREATE TABLE t (x TEXT)").connection.commit()
    before = keep.read_bytes()
    (tmp_path / "notdb.sqlite").write_text("not a database")
    cases = [(("missing.sqlite", "out.sqlite"), "missing.sqlite: no such file"),
             (("notdb.sqlite", keep), "not an SQLite database"),
             ((keep, tmp_path / "nodir" / "out.sqlite"), "no such directory"),
             ((keep, tmp_path), "a directory"),
             (("--bogus", "x.sqlite"), "usage: strip_export.py"),
             (("only-one.sqlite",), "usage: strip_export.py"),
             (("missing.json", "out.json"), "missing.json: no such file")]
    for args, message in cases:
        before_files = sorted(p.name for p in tmp_path.iterdir())
        proc = _cli(*args, cwd=tmp_path)
        assert proc.returncode == 2, (args, proc.returncode, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (args, lines)
        assert sorted(p.name for p in tmp_path.iterdir()) == before_files, args
    assert keep.read_bytes() == before


def test_cli_failed_work_leaves_the_destination_as_it_was(tmp_path):
    """A source with an SQLite header and a corrupt body passes the checks and fails in SQLite itself: exit 1 with
    one line, the existing destination untouched and no temporary file left beside it."""
    src = tmp_path / "corrupt.sqlite"
    src.write_bytes(b"SQLite format 3\x00" + bytes(range(256)) * 16)
    dst = tmp_path / "fixture.sqlite"
    dst.write_bytes(b"the committed fixture")
    proc = _cli(src, dst, cwd=tmp_path)
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, (proc.returncode, proc.stderr)
    assert "fixture.sqlite not written" in proc.stderr
    assert dst.read_bytes() == b"the committed fixture"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corrupt.sqlite", "fixture.sqlite"]


def test_strip_manifest_scrubs_command_steps_and_tools(tmp_path):
    m = {"status": "complete", "command": ["/opt/torch/.venv/bin/python3", "-m", "pipelines.capture"],
         "tools": {"nsys": {"path": "/opt/nvidia/nsight-compute/2025.3.1/host/target-linux-x64/nsys",
                            "version": "2025.3.1"}},
         "steps": [{"name": "nsys profile", "command": ["/usr/local/cuda/bin/ncu", "-o", "runs/x/ncu"],
                    "exit_code": 0}],
         "workloads": [{"name": "logp-fused", "fused_patterns": ["rlkernel_*"], "bytes": 10}]}
    src, dst = tmp_path / "src.json", tmp_path / "manifest.json"
    src.write_text(json.dumps(m, indent=1))
    load_tool().strip_manifest(str(src), str(dst))
    out = json.loads(dst.read_text())
    assert out["command"] == ["<path>/python3", "-m", "pipelines.capture"]
    assert out["tools"]["nsys"] == {"path": "<path>/nsys", "version": "2025.3.1"}
    assert out["steps"][0]["command"] == ["<path>/ncu", "-o", "runs/x/ncu"]
    assert out["workloads"] == m["workloads"] and out["status"] == "complete"
    with pytest.raises(ValueError, match="same file"):
        load_tool().strip_manifest(str(dst), str(dst))


def _fixtures(pattern):
    root = TOOL.parent.parent.parent
    return [*root.glob(f"tests/data/**/{pattern}"), *root.glob(f"pipelines/example/{pattern}")]


def test_committed_fixtures_hold_no_environment():
    fixtures = _fixtures("*.sqlite")
    assert fixtures
    for f in fixtures:
        con = sqlite3.connect(f"file:{f}?mode=ro", uri=True)
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if "TARGET_INFO_SYSTEM_ENV" in tables:
            assert con.execute("SELECT count(*) FROM TARGET_INFO_SYSTEM_ENV").fetchone()[0] == 0, f
        env = con.execute("SELECT count(*) FROM StringIds WHERE value GLOB '[A-Z_]*=*' "
                          "AND substr(value, 1, instr(value, '=') - 1) NOT GLOB '*[^A-Za-z0-9_]*'").fetchone()[0]
        assert env == 0, f"{f} holds environment strings"


def test_committed_fixtures_hold_no_absolute_paths():
    fixtures = _fixtures("*.sqlite")
    assert fixtures
    for f in fixtures:
        con = sqlite3.connect(f"file:{f}?mode=ro", uri=True)
        for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type='table'").fetchall():
            for c in [r[1] for r in con.execute(f'PRAGMA table_info("{t}")')]:
                for (v,) in con.execute(f'SELECT DISTINCT "{c}" FROM "{t}" WHERE typeof("{c}") = \'text\''):
                    assert not any(a in v for a in ABSOLUTE), f"{f}: {t}.{c} holds {v[:120]!r}"
    manifests = [*_fixtures("manifest.json"), *_fixtures("recorded.json")]
    assert len(manifests) >= 3
    for f in manifests:
        text = f.read_text()
        assert not any(a in text for a in ABSOLUTE), f"{f} holds an absolute path"
