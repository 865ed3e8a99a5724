"""tools/traces/strip_export.py, which makes committed fixtures: environment out, paths and host scrubbed."""
from __future__ import annotations

import importlib.util
import pathlib
import socket
import sqlite3

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


def test_committed_fixtures_hold_no_environment():
    root = TOOL.parent.parent.parent
    fixtures = [*root.glob("tests/data/**/*.sqlite"), *root.glob("pipelines/example/*.sqlite")]
    assert fixtures
    for f in fixtures:
        con = sqlite3.connect(f"file:{f}?mode=ro", uri=True)
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if "TARGET_INFO_SYSTEM_ENV" in tables:
            assert con.execute("SELECT count(*) FROM TARGET_INFO_SYSTEM_ENV").fetchone()[0] == 0, f
        env = con.execute("SELECT count(*) FROM StringIds WHERE value GLOB '[A-Z_]*=*' "
                          "AND substr(value, 1, instr(value, '=') - 1) NOT GLOB '*[^A-Za-z0-9_]*'").fetchone()[0]
        assert env == 0, f"{f} holds environment strings"
