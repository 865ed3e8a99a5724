"""--require-no-sync (issue 18, item 4): exit 1 when an instance that must not block holds a host sync.

tests/data/example_with_sync is the bundled example as it was on 2026-12-03 (its fused path syncs after the op
range closes, inside the workload repetition); sync_loop holds syncs in some ranges and none in others."""
from __future__ import annotations

import pytest

from pipelines import analyze
from tests.nsys_reference import DATA

pytestmark = pytest.mark.smoke


def run(tmp_path, *args):
    out = tmp_path / "out"
    return analyze.main([*map(str, args), "--out", str(out)]), out


def test_catches_the_sync_in_the_examples_fused_repetition(tmp_path, capsys):
    rc, out = run(tmp_path, DATA / "example_with_sync", "--require-no-sync")
    err = capsys.readouterr().err
    assert rc == 1
    # The single-op fused workloads' repetitions hold the item() sync; its op ranges do not.
    assert "host sync: workload rlkernel:logp-fused #1: cudaStreamSynchronize" in err
    assert "(cuda_api_sync) at " in err and "blocking " in err
    assert "host sync: op " not in err
    assert "host sync:" in (out / "report.html").read_text()  # the reports are written first
    assert (out / "dispatch.csv").is_file()


def test_without_the_flag_the_same_trace_passes(tmp_path, capsys):
    rc, _ = run(tmp_path, DATA / "example_with_sync")
    assert rc == 0 and "host sync" not in capsys.readouterr().err


def test_range_option_judges_named_ranges(tmp_path, capsys):
    rc, _ = run(tmp_path, DATA / "sync_loop" / "trace.sqlite", "--range", "rl:op.fwd", "--require-no-sync")
    assert rc == 0, capsys.readouterr().err  # the op range closes before the item() sync
    rc, _ = run(tmp_path, DATA / "sync_loop" / "trace.sqlite", "--range", "blocking", "--require-no-sync")
    err = capsys.readouterr().err
    assert rc == 1
    for call in ("cudaMemcpy_v3020 (cuda_memcpy_sync)", "cudaDeviceSynchronize_v3020 (cuda_api_sync)"):
        assert f"workload rl:blocking #1: {call}" in err
    assert "rl:blocking #4:" in err


def test_a_training_step_may_sync_between_its_ops(tmp_path, capsys):
    """grpo-step fuses several ops (sample, logp): its repetitions are not judged, its op ranges are."""
    rc, _ = run(tmp_path, DATA / "verdicts", "--require-no-sync")
    err = capsys.readouterr().err
    assert "grpo-step #" not in err
    assert rc == (1 if "host sync:" in err else 0)


def test_ranks_run_the_check_on_every_rank(tmp_path, capsys):
    """--ranks DIR --require-no-sync: each rank's held syncs, named with the rank; --ranks once skipped the check."""
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    for r in (0, 1):
        (ranks / f"trace_rank{r}.sqlite").symlink_to((DATA / "example_with_sync" / "trace.sqlite").resolve())
    rc, out = run(tmp_path, "--ranks", ranks, "--require-no-sync")
    err = capsys.readouterr().err
    assert rc == 1, err
    for r in (0, 1):
        assert f"host sync: rank {r}: workload rlkernel:logp-fused #1: cudaStreamSynchronize" in err
    assert "host sync:" in (out / "report.html").read_text()
    rc, _ = run(tmp_path, "--ranks", ranks)
    assert rc == 0 and "host sync" not in capsys.readouterr().err
