"""Issue 29, the `analyze --ranks` side (items 5, 6, 7, 11, 12, 14-19): bad rank folders, exports and executors
found by a red-team pass, each refused with one line and the conventional exit code (or handled), never a hang.
Built from the real committed exports modified with sqlite3; servers bind 127.0.0.1 only, every wait is bounded."""
from __future__ import annotations

import csv
import http.server
import os
import pathlib
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time

import pytest

from pipelines import analyze
from tests.nsys_reference import DATA
from tests.subprocess_env import pythonpath

INT64_MIN, INT64_MAX = -2 ** 63, 2 ** 63 - 1
ROOT = pathlib.Path(__file__).resolve().parent.parent
RANKS = DATA / "ranks"


def main(*argv):
    return analyze.main([str(a) for a in argv])


def errors(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if not ln.startswith("analyze: ")]  # the progress lines


def one_line(capsys, code: int, *argv) -> str:
    rc = main(*argv)
    err = errors(capsys.readouterr().err)
    assert rc == code and len(err) == 1 and err[0].startswith("pipelines.analyze: "), (rc, err)
    return err[0]


def cli(*argv, timeout: float = 25, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m pipelines.analyze ARGV` in a subprocess, killed after ``timeout`` s (a hang fails the test)."""
    e = {**os.environ, **(env or {})}
    e["PYTHONPATH"] = pythonpath()
    return subprocess.run([sys.executable, "-m", "pipelines.analyze", *map(str, argv)], capture_output=True,
                          text=True, env=e, timeout=timeout, cwd=ROOT)


def cli_one_line(code: int, *argv, timeout: float = 25) -> str:
    r = cli(*argv, timeout=timeout)
    err = errors(r.stderr)
    assert r.returncode == code and len(err) == 1 and err[0].startswith("pipelines.analyze: "), (r.returncode,
                                                                                                r.stderr)
    assert "Traceback" not in r.stderr
    return err[0]


def rank_folder(tmp_path, n: int = 2, names: list[str] | None = None) -> pathlib.Path:
    """A folder of per-rank exports: copies of the committed 3-rank job's exports."""
    d = tmp_path / "job"
    d.mkdir()
    for i, name in enumerate(names or [f"trace_rank{i}.sqlite" for i in range(n)]):
        shutil.copy(RANKS / f"trace_rank{i}.sqlite", d / name)
    return d


def apply(path: pathlib.Path, *sql: str) -> None:
    con = sqlite3.connect(path)
    for q in sql:
        con.execute(q)
    con.commit()
    con.close()


def without_constraints(table: str) -> list[str]:
    """SQL that rebuilds ``table`` without its NOT NULL / PRIMARY KEY constraints (CREATE TABLE AS keeps none)."""
    return [f"CREATE TABLE _copy AS SELECT * FROM {table}", f"DROP TABLE {table}",
            f"ALTER TABLE _copy RENAME TO {table}"]


# ------------------------------------------------------------------------------------------- item 5: dangling link

def test_item5_dangling_rank_symlink_is_an_error_naming_it(tmp_path, capsys):
    d = rank_folder(tmp_path, 2)
    (d / "trace_rank2.sqlite").symlink_to(tmp_path / "gone" / "trace_rank2.sqlite")
    for extra in ((), ("--require-fused",)):
        line = one_line(capsys, 2, "--ranks", d, "--jobs", "1", "--out", tmp_path / "rep", *extra)
        assert "trace_rank2.sqlite" in line and "dangling" in line, line
        assert not (tmp_path / "rep").exists()
    # a dangling link to a run directory (no suffix) is refused too: it may have been a rank
    (d / "trace_rank2.sqlite").unlink()
    (d / "rank2").symlink_to(tmp_path / "gone")
    assert "rank2" in one_line(capsys, 2, "--ranks", d, "--jobs", "1", "--out", tmp_path / "rep")


# -------------------------------------------------------------------------------------- item 6: duplicated StringIds

def test_item6_duplicated_string_ids_are_refused_with_one_line(tmp_path, capsys):
    d = rank_folder(tmp_path, 2)
    apply(d / "trace_rank1.sqlite", *without_constraints("StringIds"), "INSERT INTO StringIds SELECT * FROM StringIds")
    line = one_line(capsys, 2, "--ranks", d, "--jobs", "1", "--out", tmp_path / "rep")
    assert "trace_rank1.sqlite" in line and "StringIds" in line and "more than once" in line, line
    assert not (tmp_path / "rep").exists()
    # the single-trace path refuses it the same way
    line = one_line(capsys, 2, d / "trace_rank1.sqlite", "--out", tmp_path / "rep")
    assert "StringIds" in line and "more than once" in line


# ------------------------------------------------------------------------------------------- item 7: rank numbers

def test_item7_rank_numbers_stay_integral_or_are_refused(tmp_path, capsys):
    d = rank_folder(tmp_path, names=["trace_rank0.sqlite", f"trace_rank{INT64_MAX}.sqlite"])
    out = tmp_path / "rep"
    assert main("--ranks", d, "--jobs", "1", "--out", out) == 0
    for name in ("kernel_summary.csv", "cross_rank.csv", "ranks.csv", "range_summary.csv"):
        with open(out / name, newline="") as f:
            got = {r["rank"] for r in csv.DictReader(f)}
        assert got == {"0", str(INT64_MAX)}, (name, got)
    big = tmp_path / "big"
    big.mkdir()
    shutil.copy(d / "trace_rank0.sqlite", big / "trace_rank0.sqlite")
    shutil.copy(d / "trace_rank0.sqlite", big / "trace_rank99999999999999999999.sqlite")
    line = one_line(capsys, 2, "--ranks", big, "--jobs", "1", "--out", tmp_path / "rep2")
    assert "trace_rank99999999999999999999.sqlite" in line and "64-bit" in line, line
    assert not (tmp_path / "rep2").exists()


# ----------------------------------------------------------------------------------- items 11, 12, 15, 16: executors

def test_item11_dask_scheduler_without_workers_exits_3_at_once(tmp_path):
    distributed = pytest.importorskip("distributed", reason="the dask extra is not installed here")
    with distributed.LocalCluster(n_workers=0, processes=False, protocol="tcp", host="127.0.0.1",
                                  dashboard_address=None) as c:
        address = c.scheduler_address.removeprefix("tcp://")
        t0 = time.monotonic()
        line = cli_one_line(3, "--ranks", DATA / "multiproc", "--out", tmp_path / "rep", "--executor",
                            f"dask://{address}")
        assert time.monotonic() - t0 < 20
    assert "no workers" in line, line
    assert not (tmp_path / "rep").exists()


class _Silent:
    """A TCP port on 127.0.0.1 that accepts connections and never sends a byte."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self):
        self.sock.close()
        for c in self.held:
            c.close()


def test_item12_port_that_accepts_and_never_speaks_exits_3_in_bounded_time(tmp_path):
    pytest.importorskip("distributed", reason="the dask extra is not installed here")
    server = _Silent()
    try:
        t0 = time.monotonic()
        line = cli_one_line(3, "--ranks", DATA / "multiproc", "--out", tmp_path / "rep", "--executor",
                            f"dask://127.0.0.1:{server.port}")
        assert time.monotonic() - t0 < 20
    finally:
        server.close()
    assert f"127.0.0.1:{server.port}" in line and "Dask" in line, line
    assert not (tmp_path / "rep").exists()


@pytest.mark.parametrize("address", ["127.0.0.1", "host:bar", "tcp://127.0.0.1:8786", "127.0.0.1:99999",
                                     "127.0.0.1:-5", ":8786", "127.0.0.1:"])
def test_item15_malformed_dask_address_is_one_line_exit_2_at_once(tmp_path, capsys, address):
    t0 = time.monotonic()
    line = one_line(capsys, 2, "--ranks", DATA / "multiproc", "--out", tmp_path / "rep", "--executor",
                    f"dask://{address}")
    assert time.monotonic() - t0 < 10
    assert f"dask://{address}" in line and "HOST:PORT" in line, line


def test_item16_non_dask_server_on_the_port_exits_3_with_one_line(tmp_path):
    pytest.importorskip("distributed", reason="the dask extra is not installed here")

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    port = httpd.server_address[1]
    try:
        line = cli_one_line(3, "--ranks", DATA / "multiproc", "--out", tmp_path / "rep", "--executor",
                            f"dask://127.0.0.1:{port}")
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert f"127.0.0.1:{port}" in line and "Dask" in line, line


# --------------------------------------------------------------------------------- item 14: kill -9 of the parent

def _children(pid: int) -> list[int]:
    kids = []
    for p in pathlib.Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            kids.append(int(p.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _maps_duckdb(pid: int) -> bool:
    try:
        return "duckdb" in pathlib.Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("when", ["starting", "running"])
def test_item14_pool_workers_die_with_a_killed_parent(tmp_path, when):
    """kill -9 of analyze while its workers start (before their initializer could run) and while they analyse."""
    d = rank_folder(tmp_path, 3)
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.analyze", "--ranks", str(d), "--jobs", "2", "--out",
                             str(tmp_path / "rep")], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    kids: list[int] = []
    try:
        deadline = time.monotonic() + 20
        # the two pool workers and the resource tracker
        while time.monotonic() < deadline and len(kids) < 3 and proc.poll() is None:
            kids = _children(proc.pid)
            time.sleep(0.02)
        assert len(kids) >= 2, f"the pool did not start before the run ended (children {kids})"
        if when == "running":  # both workers have imported the analyzer (DuckDB mapped): past the initializer
            while time.monotonic() < deadline and proc.poll() is None and \
                    sum(_maps_duckdb(k) for k in kids) < 2:
                time.sleep(0.02)
            time.sleep(0.3)
        assert proc.poll() is None, "the run ended before the kill"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(k) for k in kids):
            time.sleep(0.05)
        left = [k for k in kids if _alive(k)]
        assert not left, f"still alive 10 s after kill -9 of their parent: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
        for k in kids:  # the processes this test started, by id, when the fix does not hold
            if _alive(k):
                os.kill(k, signal.SIGKILL)


# ------------------------------------------------------------------------------- item 17: session start extremes

@pytest.mark.parametrize("start", [INT64_MAX, INT64_MIN], ids=["max", "min"])
def test_item17_extreme_session_start_of_a_rank_is_values_out_of_range(tmp_path, capsys, start):
    d = rank_folder(tmp_path, 2)
    apply(d / "trace_rank1.sqlite", f"UPDATE TARGET_INFO_SESSION_START_TIME SET utcEpochNs = {start}")
    line = one_line(capsys, 2, "--ranks", d, "--jobs", "1", "--out", tmp_path / "rep")
    assert "trace_rank1.sqlite: values out of range for 64-bit arithmetic" in line, line
    assert not (tmp_path / "rep").exists()


# ---------------------------------------------------------------------------- item 18: NULL process or device ids

@pytest.mark.parametrize("column", ["globalPid", "deviceId"])
def test_item18_null_process_or_device_in_a_multi_process_export_is_one_line(tmp_path, capsys, column):
    d = tmp_path / "job"
    d.mkdir()
    t = d / "trace.sqlite"
    shutil.copy(DATA / "multiproc" / "trace.sqlite", t)
    apply(t, *without_constraints("CUPTI_ACTIVITY_KIND_KERNEL"),
          f"UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET {column} = NULL "
          "WHERE rowid = (SELECT min(rowid) FROM CUPTI_ACTIVITY_KIND_KERNEL)")
    line = one_line(capsys, 2, "--ranks", d, "--jobs", "1", "--out", tmp_path / "rep")
    assert "trace.sqlite" in line and column in line and "NULL" in line, line
    assert not (tmp_path / "rep").exists()


# ---------------------------------------------------------------------------- item 19: RLKERNEL_ANALYZE_MEMORY

@pytest.mark.parametrize("value", ["foo", "100%", ""], ids=["foo", "percent", "empty"])
def test_item19_bad_analyze_memory_is_one_line_exit_2(tmp_path, capsys, monkeypatch, value):
    monkeypatch.setenv("RLKERNEL_ANALYZE_MEMORY", value)
    for argv in (["--ranks", rank_folder(tmp_path, 2), "--jobs", "1"], [DATA / "verdicts"]):
        line = one_line(capsys, 2, *argv, "--out", tmp_path / "rep")
        assert f"RLKERNEL_ANALYZE_MEMORY={value!r}" in line and "2GB" in line, line
        assert not (tmp_path / "rep").exists()
        shutil.rmtree(tmp_path / "job", ignore_errors=True)
    monkeypatch.setenv("RLKERNEL_ANALYZE_MEMORY", "1.5GiB")  # what DuckDB takes still works
    assert main(DATA / "verdicts", "--out", tmp_path / "rep") == 0
