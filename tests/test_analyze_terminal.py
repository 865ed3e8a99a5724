"""What the analyzer says on the terminal (issue 40): which input a bare run read, one line per workload of
--compare, and --force on runs that are not comparable."""
from __future__ import annotations

import shutil
import sqlite3

from pipelines import analyze, inputs
from tests.nsys_reference import DATA


def test_a_bare_run_says_it_reads_the_bundled_example(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no runs/ here
    assert analyze.main([]) == 0
    err = capsys.readouterr().err.splitlines()
    assert ("pipelines.analyze: no INPUT given and no complete run under ./runs: analysing the example trace bundled "
            f"with the package ({inputs.EXAMPLE_DIR})") in err


def _halved_baseline(tmp_path):
    base = tmp_path / "base"
    shutil.copytree(DATA / "verdicts", base)
    con = sqlite3.connect(base / "trace.sqlite")
    for t in ("CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMSET"):
        con.execute(f'UPDATE {t} SET start = start / 2, "end" = "end" / 2')
    con.commit()
    con.close()
    return base


def test_compare_prints_one_line_per_workload(tmp_path, capsys):
    same = analyze.main([str(DATA / "verdicts"), "--compare", str(DATA / "verdicts"), "--out", str(tmp_path / "a")])
    out = capsys.readouterr().out.splitlines()
    assert same == 0
    assert "  rlkernel:grpo-step: +0.0 % GPU busy vs baseline, no regression" in out
    assert analyze.main([str(DATA / "verdicts"), "--compare", str(_halved_baseline(tmp_path)),
                         "--out", str(tmp_path / "b")]) == 1
    out = capsys.readouterr().out.splitlines()
    line = next(ln for ln in out if ln.startswith("  rlkernel:grpo-step: ") and "vs baseline" in ln)
    assert line.endswith("% GPU busy vs baseline, REGRESSION") and float(line.split()[1]) > 90


def test_force_on_runs_not_comparable_says_so_and_exits_as_the_comparison(tmp_path, capsys):
    base = tmp_path / "base"
    shutil.copytree(DATA / "verdicts", base)
    con = sqlite3.connect(base / "trace.sqlite")
    con.execute("UPDATE TARGET_INFO_GPU SET name = 'NVIDIA A100-SXM4-80GB'")
    con.commit()
    con.close()
    rc = analyze.main([str(DATA / "verdicts"), "--compare", str(base), "--force", "--out", str(tmp_path / "c")])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("pipelines.analyze: --force")]
    assert rc == 0 and len(err) == 1 and "not comparable (GPU NVIDIA A100-SXM4-80GB in the baseline" in err[0]
    assert "only a regression makes the exit code 1" in err[0]
    assert "regression)" in " ".join(analyze.parser().format_help().split())  # --help documents the exit code
