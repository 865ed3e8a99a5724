"""tools/sampler_timeline/instrument.py on the real kernels: every probe lands at its anchor (so the timeline tool
stays in step with csrc/), a missing anchor stops it with exit 1 and leaves no copy behind."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "sampler_timeline" / "instrument.py"
KERNELS = Path("include/rlkernel/sampling_kernels.cuh")


def _run(*args):
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True, check=False)


def test_every_probe_lands_in_the_kernels(tmp_path):
    r = _run(ROOT / "csrc", tmp_path / "probed")
    assert r.returncode == 0, r.stderr
    probed = (tmp_path / "probed" / KERNELS).read_text()
    original = (ROOT / "csrc" / KERNELS).read_text()
    assert probed.count("  RLK_TL_CAND_START\n") == 1
    assert probed.count("RLK_TL_CAND_CHUNK(it)\n") == 1
    for i in range(6):
        assert probed.count(f"RLK_TL_SEL({i})\n") == 1, i
    # the probes are added, nothing else changes
    stripped = "\n".join(line for line in probed.splitlines() if "RLK_TL_" not in line)
    assert all(line in stripped for line in original.splitlines() if line.strip())
    assert (tmp_path / "probed" / "sampling.cu").read_text() == (ROOT / "csrc" / "sampling.cu").read_text()


def test_a_missing_anchor_stops_it_and_leaves_no_copy(tmp_path):
    src = tmp_path / "csrc"
    (src / KERNELS).parent.mkdir(parents=True)
    text = (ROOT / "csrc" / KERNELS).read_text().replace("  if (m > 0) {\n", "  if (m != 0) {\n")
    (src / KERNELS).write_text(text)
    r = _run(src, tmp_path / "probed")
    assert r.returncode == 1
    assert "anchor found 0 times" in r.stderr and "if (m > 0)" in r.stderr
    assert not (tmp_path / "probed").exists() and not (tmp_path / "probed.partial").exists()


def test_usage():
    r = _run()
    assert r.returncode == 2 and "SRC_CSRC DST_DIR" in r.stdout
    assert _run("--help").returncode == 0
