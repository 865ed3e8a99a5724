"""The hottest source lines of one kernel from an ncu source-page CSV (`ncu -i R --page source --csv ...`).

    python tools/ncu_hot_lines.py FILE.csv [--top 30]

ncu writes one table per kernel/source file: a header row naming the columns ("# Address"/"Line", "Source",
"Warp Stall Sampling (All Samples)", "Instructions Executed", ...) then one row per line. Rows are ranked by
stall samples (where the warps spent their time), with their share of the table's total and instructions.
"""
from __future__ import annotations

import argparse
import csv
import sys

STALL = "Warp Stall Sampling (All Samples)"
INSTR = "Instructions Executed"


def tables(path):
    rows, header = [], None
    with open(path, newline="", errors="replace") as fh:
        for rec in csv.reader(fh):
            if STALL in rec and "Source" in rec:
                if header and rows:
                    yield header, rows
                header, rows = rec, []
            elif header and len(rec) == len(header):
                rows.append(dict(zip(header, rec, strict=True)))
    if header and rows:
        yield header, rows


def num(s):
    try:
        return float(str(s).replace(",", ""))
    except ValueError:
        return 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    found = False
    for header, rows in tables(args.csv):
        total = sum(num(r[STALL]) for r in rows) or 1.0
        if total <= 1.0:
            continue
        found = True
        where = next((h for h in header if h in ("# Address", "Address", "# Line", "Line")), header[0])
        print(f"--- {len(rows)} rows, {total:.0f} stall samples, {sum(num(r.get(INSTR, 0)) for r in rows):.0f} instrs")
        for r in sorted(rows, key=lambda r: -num(r[STALL]))[: args.top]:
            print(f"{num(r[STALL]) / total * 100:5.1f}% {num(r.get(INSTR, 0)):>10.0f}  {r[where]:>6}  "
                  f"{r['Source'].strip()[:110]}")
    if not found:
        print("ncu_hot_lines: no source table with stall samples in", args.csv, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
