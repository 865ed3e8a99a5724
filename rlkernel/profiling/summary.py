"""The terminal table printed at the end of a run (one line per row, the columns a reader checks first).

Notes that several rows share (the smoke run's "repeat 1: ..." above all) are printed once, in full, under the
table; a row's cell keeps only its own notes, cut to the column's width. Figures print at three significant
digits or more, never in exponent form. A fused row's "vs native" is the native row's median over its own, for the
same shape and dtype (``logp-fused`` against ``logp-native``): 17.6x means the fused path took 1/17.6 of the time.
"""
from __future__ import annotations

import math

from rlkernel.profiling.rows import SMOKE_NOTE

_HEADERS = ("workload", "BxSxV", "dtype", "status", "dispatch", "median ms", "p20-p80 ms", "vs native", "GB/s",
            "% peak", "notes")


def fmt(value: float | None) -> str:
    """At least three significant digits, in plain decimal: 30.3, 1.250, 0.0000390 (not 3.896474296110331e-05)."""
    if value is None:
        return "-"
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    if abs(value) >= 100:
        return f"{value:.1f}"
    if abs(value) >= 1:
        return f"{value:.3f}"
    return f"{value:.{2 - math.floor(math.log10(abs(value)))}f}"


def _key(row: dict) -> tuple:
    return row["batch_size"], row["seq_len"], row["vocab_size"], row["dtype"]


def _speedup(row: dict, native_ms: dict) -> str:
    """native median / this fused row's median, when both were timed; '-' otherwise."""
    if "-fused" not in row["workload"] or not row["latency_ms"]:
        return "-"
    base = native_ms.get((row["workload"].replace("-fused", "-native", 1), *_key(row)))
    return "-" if not base else f"{base / row['latency_ms']:.3g}x"


def _split(notes: str | None) -> list[str]:
    return [n for n in (notes or "").split("; ") if n]


def _cells(row: dict, own_notes: list[str], notes_width: int, native_ms: dict) -> tuple[str, ...]:
    spread = "-" if row["latency_p20_ms"] is None else f"{fmt(row['latency_p20_ms'])}-{fmt(row['latency_p80_ms'])}"
    notes = "; ".join(own_notes)
    if len(notes) > notes_width:
        notes = notes[: notes_width - 3] + "..."
    pct = "-" if row["pct_of_peak_bandwidth"] is None else f"{row['pct_of_peak_bandwidth']:.1f}"
    return (row["workload"], f"{row['batch_size']}x{row['seq_len']}x{row['vocab_size']}", row["dtype"],
            row["status"], row["dispatch"] or "-", fmt(row["latency_ms"]), spread, _speedup(row, native_ms),
            fmt(row["achieved_gbps"]), pct, notes)


def table(rows: list[dict], notes_width: int = 60) -> str:
    notes = [_split(r["notes"]) for r in rows]
    seen: dict[str, int] = {}
    for row_notes in notes:
        for n in dict.fromkeys(row_notes):
            seen[n] = seen.get(n, 0) + 1
    shared = [n for n, k in seen.items() if k > 1 or n == SMOKE_NOTE]
    native_ms = {(r["workload"], *_key(r)): r["latency_ms"] for r in rows if r["latency_ms"]}
    lines = [_HEADERS] + [_cells(r, [n for n in ns if n not in shared], notes_width, native_ms)
                          for r, ns in zip(rows, notes, strict=True)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(_HEADERS))]
    out = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    counts = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    out.append(f"{len(rows)} rows: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    out += [f"note ({seen[n]} of {len(rows)} rows): {n}" for n in shared]
    return "\n".join(out)


def progress_line(i: int, n: int, row: dict) -> str:
    timing = f" {fmt(row['latency_ms'])} ms" if row["latency_ms"] is not None else ""
    return (f"[{i}/{n}] {row['workload']} B={row['batch_size']} S={row['seq_len']} V={row['vocab_size']} "
            f"{row['dtype']}: {row['status']} ({row['dispatch'] or '-'}){timing}")
