"""The analyzer's write phase under kill -9 and concurrency (issue 19, items 2 and 3): real analyze processes,
stopped at a known instant of the write phase by its test hook (RLKERNEL_ANALYZE_TEST_PAUSE=<stage>:<gate>),
then killed or let go."""
from __future__ import annotations

import csv
import os
import pathlib
import queue
import signal
import subprocess
import sys
import threading

import pytest

from pipelines import analysis, analyze
from tests.nsys_reference import DATA
from tests.subprocess_env import pythonpath

ROOT = pathlib.Path(__file__).resolve().parent.parent
# nvtx_mix and no_cuda: traces of other programs (no rlkernel ranges), so the subprocess imports no torch
CASE = DATA / "nvtx_mix"
SET = {"dispatch.csv", "gaps.csv", "kernel_summary.csv", "range_kernels.csv", "range_summary.csv",
       "repetition_gaps.csv", "report.html", "utilization.csv"}


class Analyze:
    """``python -m pipelines.analyze ARGS`` in a process of its own, its stderr read line by line."""

    def __init__(self, *args, pause: str | None = None, gate: pathlib.Path | None = None):
        env = dict(os.environ, PYTHONPATH=pythonpath())
        env.pop("RLKERNEL_ANALYZE_TEST_PAUSE", None)
        if pause:
            env["RLKERNEL_ANALYZE_TEST_PAUSE"] = f"{pause}:{gate}"
        self.proc = subprocess.Popen([sys.executable, "-m", "pipelines.analyze", *map(str, args)], cwd=ROOT,
                                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for(self, text: str, timeout: float = 60.0) -> None:
        seen = []
        while True:
            line = self.lines.get(timeout=timeout)
            assert line is not None, f"exited {self.proc.wait()} before {text!r}: {seen}"
            seen.append(line)
            if text in line:
                return

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        assert self.proc.wait(timeout=30) == -signal.SIGKILL


def assert_complete(out: pathlib.Path, names=SET) -> None:
    """``out`` is one whole set: exactly the expected files, every CSV with its full header, the HTML closed."""
    assert {p.name for p in out.iterdir()} == names
    for name, cols in analysis.COLUMNS.items():
        if f"{name}.csv" in names:
            with open(out / f"{name}.csv", newline="") as f:
                assert next(csv.reader(f)) == cols
    assert (out / "report.html").read_text().rstrip().endswith("</html>")


def leftovers(parent: pathlib.Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("stage", ["writing", "switch", "cleanup"])
def test_kill_9_in_the_write_phase_leaves_a_whole_set_and_the_next_run_cleans_up(tmp_path, stage):
    out = tmp_path / "rep"
    assert analyze.main([str(CASE), "--out", str(out)]) == 0  # the previous set
    run = Analyze(CASE, "--out", out, pause=stage, gate=tmp_path / "never")
    run.wait_for(f"test pause at {stage}")
    assert_complete(out)  # paused inside the write phase: the previous set is in place
    run.kill()
    assert_complete(out)
    if stage != "switch":
        assert leftovers(tmp_path), "the kill left no temporary: the test does not reach the write phase"
    assert analyze.main([str(CASE), "--out", str(out)]) == 0
    assert_complete(out)
    assert leftovers(tmp_path) == []


def test_a_set_moved_aside_by_an_older_run_is_put_back_and_cleaned(tmp_path):
    # What a kill between the two renames of the fallback (and of earlier analyzers) leaves: no rep/, the
    # previous whole set hidden as .rep.old-*, a partial .rep.new-*.
    out = tmp_path / "rep"
    assert analyze.main([str(CASE), "--out", str(out)]) == 0
    os.rename(out, tmp_path / ".rep.old-abc123")
    (tmp_path / ".rep.new-abc123").mkdir()
    (tmp_path / ".rep.new-abc123" / "kernel_summary.csv").write_bytes(b"")
    assert analyze.main([str(DATA / "no_cuda"), "--out", str(out)]) == 0
    assert_complete(out, SET)
    assert leftovers(tmp_path) == []


def test_two_runs_on_one_directory_both_finish_and_the_last_writer_wins(tmp_path):
    out = tmp_path / "rep"
    gate = tmp_path / "go"
    first = Analyze(CASE, "--out", out, pause="switch", gate=gate)
    first.wait_for("test pause at switch")  # holds the directory, its set written, not yet switched in
    second = Analyze(DATA / "no_cuda", "--out", out)
    second.wait_for("waiting for another run")
    gate.touch()
    assert first.proc.wait(timeout=60) == 0
    assert second.proc.wait(timeout=60) == 0
    assert_complete(out)
    assert (out / "kernel_summary.csv").read_text().count("\n") == 1  # no_cuda's set: no kernels
    assert leftovers(tmp_path) == []


def test_two_rename_fallback_swaps_the_sets(tmp_path):
    # where no atomic exchange exists (outdir._rename_over): the new set ends in place, the old one in tmp
    from pipelines import outdir

    out, tmp = tmp_path / "rep", tmp_path / ".rep.new-x1"
    for d, text in ((out, "old"), (tmp, "new")):
        d.mkdir()
        (d / "report.html").write_text(text)
    outdir._rename_over(tmp, out)
    assert (out / "report.html").read_text() == "new" and (tmp / "report.html").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".rep.new-x1", "rep"]
