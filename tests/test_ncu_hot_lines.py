"""tools/ncu_hot_lines.py on an excerpt of a real ncu source page (`ncu -i R --page source --print-source sass
--csv`, rlkernel_sample_candidates<float> on the H200): rows ranked by warp stall samples, shares of the table."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "ncu_hot_lines.py"
EXCERPT = ROOT / "tests" / "data" / "ncu_source_sass_excerpt.csv"


def _run(*args):
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True, check=False)


def test_ranks_rows_by_stall_samples():
    r = _run(EXCERPT, "--top", "3")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("--- 18 rows, 1988 stall samples")
    ranked = lines[1:]
    assert len(ranked) == 3
    # the barrier wait after the bound search: 1629 of the excerpt's 1988 samples
    assert ranked[0].split()[0] == "81.9%" and "LDS R4, [UR17+0x400]" in ranked[0]
    assert "SHF.R.S32.HI R20" in ranked[1] and "BRA 0x7fb67f7a7ca0" in ranked[2]


def test_a_file_without_a_stall_table_is_an_error(tmp_path):
    plain = tmp_path / "plain.csv"
    plain.write_text('"Line No","Source"\n"1","int x;"\n')
    r = _run(plain)
    assert r.returncode == 1 and "no source table with stall samples" in r.stderr
