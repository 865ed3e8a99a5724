"""Durations as a person reads them (the CSVs keep the raw ns): one function for the report, the terminal lines
and the RL-step headline."""
from __future__ import annotations


def fmt_ns(v) -> str:
    """A duration in ns with 3 significant digits in the largest unit it reaches once rounded (999,600 ns is
    "1 ms", not "1e+03 µs"); "" for None or NaN."""
    if v is None or (isinstance(v, float) and v != v):
        return ""
    v = float(v)
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if abs(v) >= scale * 0.9995:  # what .3g rounds up to 1000 of the unit below
            return f"{v / scale:.3g} {unit}"
    return f"{v:.0f} ns"
