"""The terminal table printed at the end of a run (one line per row, the columns a reader checks first)."""
from __future__ import annotations

_HEADERS = ("workload", "BxSxV", "dtype", "status", "dispatch", "median ms", "p20-p80 ms", "GB/s", "% peak", "notes")


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _cells(row: dict, notes_width: int) -> tuple[str, ...]:
    spread = ("-" if row["latency_p20_ms"] is None
              else f"{row['latency_p20_ms']:.3f}-{row['latency_p80_ms']:.3f}")
    notes = row["notes"] or ""
    if len(notes) > notes_width:
        notes = notes[: notes_width - 3] + "..."
    return (row["workload"], f"{row['batch_size']}x{row['seq_len']}x{row['vocab_size']}", row["dtype"],
            row["status"], row["dispatch"] or "-", _num(row["latency_ms"], ".3f"), spread,
            _num(row["achieved_gbps"], ".2f"), _num(row["pct_of_peak_bandwidth"], ".1f"), notes)


def table(rows: list[dict], notes_width: int = 60) -> str:
    lines = [_HEADERS] + [_cells(r, notes_width) for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(_HEADERS))]
    out = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    counts = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    out.append(f"{len(rows)} rows: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    return "\n".join(out)


def progress_line(i: int, n: int, row: dict) -> str:
    timing = f" {row['latency_ms']:.3f} ms" if row["latency_ms"] is not None else ""
    return (f"[{i}/{n}] {row['workload']} B={row['batch_size']} S={row['seq_len']} V={row['vocab_size']} "
            f"{row['dtype']}: {row['status']} ({row['dispatch'] or '-'}){timing}")
