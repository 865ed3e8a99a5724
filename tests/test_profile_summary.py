"""The profile suite's terminal table (issue 40): readable figures, the smoke note whole, a fused/native column."""
from __future__ import annotations

from rlkernel.profiling import cli
from rlkernel.profiling.rows import SMOKE_NOTE
from rlkernel.profiling.summary import fmt, table


def _row(workload, ms, notes="", **kw):
    return {"workload": workload, "batch_size": 8, "seq_len": 512, "vocab_size": 128256, "dtype": "bfloat16",
            "status": "pass", "dispatch": "fused" if "fused" in workload else "native", "latency_ms": ms,
            "latency_p20_ms": ms, "latency_p80_ms": ms, "achieved_gbps": 3.896474296110331e-05,
            "pct_of_peak_bandwidth": 12.3456, "notes": notes, **kw}


def test_figures_print_at_three_significant_digits_without_exponents():
    assert [fmt(v) for v in (3.896474296110331e-05, 0.0036612, 1.25, 64.512, 1234.5678, None, 0.0)] == \
        ["0.0000390", "0.00366", "1.250", "64.512", "1234.6", "-", "0"]
    text = table([_row("logp-native", 0.0645)])
    assert "e-05" not in text and "3.896474296110331" not in text and "0.0000390" in text


def test_the_smoke_note_is_printed_whole_and_once():
    long = "a row's own note that is long enough to be cut at the notes column's sixty characters"
    text = table([_row("logp-native", 1.0, f"{long}; {SMOKE_NOTE}"), _row("sampling-native", 2.0, SMOKE_NOTE)])
    lines = text.splitlines()
    assert lines[-1] == f"note (2 of 2 rows): {SMOKE_NOTE}"
    assert sum(SMOKE_NOTE in ln for ln in lines) == 1  # not in any row's cut-off cell
    assert any(ln.endswith("...") for ln in lines[2:4])  # the row's own note is still cut to the column


def test_fused_rows_show_their_speedup_over_the_native_row_of_the_same_shape():
    rows = [_row("logp-native", 0.0645), _row("logp-fused", 0.00366), _row("sampling-fused", 1.0),
            _row("logp-fused-bwd", 1.0, seq_len=128), _row("logp-native-bwd", 4.0, seq_len=512)]
    lines = table(rows).splitlines()
    col = lines[0].index("vs native")
    assert [ln[col:].split()[0] for ln in lines[2:7]] == ["-", "17.6x", "-", "-", "-"]  # same family and shape


def test_temperature_help_does_not_contradict_itself():
    text = " ".join(cli.parser().format_help().split())
    assert "> 0 (0 =" not in text and "sampling workloads also take 0 (argmax)" in text
