"""The profile suite's report files (issue 19): never overwritten, the umask's mode, a full disk."""
from __future__ import annotations

import csv
import datetime as dt
import json
import os
import types
from pathlib import Path

import pytest

from rlkernel.profiling import cli, writers
from rlkernel.profiling.rows import COLUMNS

pytestmark = pytest.mark.smoke
PINNED = dt.datetime(2026, 12, 3, 6, 0, 0, 123456, tzinfo=dt.timezone.utc)


class _Pinned(dt.datetime):
    @classmethod
    def now(cls, tz=None):
        return PINNED


@pytest.fixture
def pinned_clock(monkeypatch):
    """Every run in the same microsecond: the file names collide (writers' own clock only)."""
    monkeypatch.setattr(writers, "dt", types.SimpleNamespace(datetime=_Pinned, timezone=dt.timezone))


def _write(folder: Path, run: int) -> list[Path]:
    row = {k: f"run{run}" for k in COLUMNS}  # every cell names the run, so a mixed pair shows
    return writers.write_reports(folder, [row], csv_out=True, json_out=True, command=f"run{run}", node={},
                                 generated_at="t")


def _pairs(folder: Path) -> dict[str, str]:
    """stem -> the run both of its files come from (asserts they agree and nothing else is there)."""
    files = sorted(folder.iterdir())
    stems = {f.name.rsplit(".", 1)[0] for f in files}
    assert sorted(f.name for f in files) == sorted(f"{s}{x}" for s in stems for x in (".csv", ".json")), files
    out = {}
    for s in stems:
        with open(folder / f"{s}.csv", newline="") as f:
            (row,) = list(csv.DictReader(f))
        doc = json.loads((folder / f"{s}.json").read_text())
        assert row["workload"] == doc["command"] == doc["rows"][0]["workload"], s
        out[s] = doc["command"]
    return out


def test_same_name_never_overwrites_a_report(tmp_path, pinned_clock, monkeypatch):
    # issue 19 item 1: the name was checked free, then os.replace'd onto: a run that took it in between was lost
    real_fsync, raced = os.fsync, []

    def another_run_takes_the_name(fd):  # while run 0 writes its files, run 1 writes and names its own
        real_fsync(fd)
        if not raced:
            raced.append(fd)
            _write(tmp_path, 1)

    monkeypatch.setattr(writers.os, "fsync", another_run_takes_the_name)
    first = _write(tmp_path, 0)
    monkeypatch.setattr(writers.os, "fsync", real_fsync)
    assert sorted(_pairs(tmp_path).values()) == ["run0", "run1"]
    assert first[0].name == "profile_20261203T060000_123456Z-2.csv"  # the next free name
    for run in range(2, 10):  # one after another in the same microsecond: each gets the next free name
        _write(tmp_path, run)
    pairs = _pairs(tmp_path)
    assert sorted(pairs.values()) == sorted(f"run{i}" for i in range(10))
    assert pairs["profile_20261203T060000_123456Z"] == "run1"
    assert pairs["profile_20261203T060000_123456Z-10"] == "run9"


def test_a_stem_with_either_file_taken_is_skipped(tmp_path, pinned_clock):
    # a --csv run and a --json run in one microsecond must not look like one pair
    (tmp_path / "profile_20261203T060000_123456Z.json").write_text("other run")
    paths = writers.write_reports(tmp_path, [], csv_out=True, json_out=False, command="x", node={},
                                    generated_at="t")
    assert [p.name for p in paths] == ["profile_20261203T060000_123456Z-2.csv"]
    assert (tmp_path / "profile_20261203T060000_123456Z.json").read_text() == "other run"


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_files_follow_the_umask(tmp_path, umask):
    # issue 19 item 23: mkstemp's 0600 stayed on the reports whatever the umask (the analyzer's follow it)
    old = os.umask(umask)
    try:
        paths = _write(tmp_path, 0)
    finally:
        os.umask(old)
    assert [oct(p.stat().st_mode & 0o777) for p in paths] == [oct(0o666 & ~umask)] * 2


def test_full_disk_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    # issue 19 item 13: a traceback. The device is full where the bytes go: the write edge writes to /dev/full,
    # which fails every write with the kernel's real ENOSPC.
    real_write = writers._write_all

    def onto_a_full_disk(fd, data):
        full = os.open("/dev/full", os.O_WRONLY)
        try:
            os.dup2(full, fd)
        finally:
            os.close(full)
        return real_write(fd, data)

    monkeypatch.setattr(writers, "_write_all", onto_a_full_disk)
    out = tmp_path / "reports"
    assert cli.main(["--device", "cpu", "--smoke", "--workloads", "logp-native", "--output-dir", str(out)]) == 2
    captured = capsys.readouterr()
    last = captured.err.strip().splitlines()[-1]
    assert last == f"run_profile_suite.py: --output-dir {out}: could not write the report: No space left on device"
    assert "Traceback" not in captured.err and "wrote" not in captured.out
    assert list(out.iterdir()) == []  # nothing partial
