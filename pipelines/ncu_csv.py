"""``ncu --csv --page raw --print-units base`` output -> the long-format ``ncu.csv`` (docs/contracts.md, section 6).

The raw page is one row per profiled kernel launch: a header of column names, a second row of units (empty
for the descriptive columns), then the launches; numbers carry thousands separators ("1,048,576"). Lines
before the header (``==PROF==`` messages) are skipped. The long format has one row per (launch, metric):
``range, instance, kernel, launch, metric, unit, value``.
"""
from __future__ import annotations

import csv
import io
import os
import pathlib

DOMAIN = "rlkernel"
LONG_COLUMNS = ("range", "instance", "kernel", "launch", "metric", "unit", "value")

# The fixed metric list of a capture (issue 7): what a memory-bound kernel is judged by.
METRICS = (
    "gpu__time_duration.sum",  # kernel duration
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",  # DRAM throughput, % of peak
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",  # SM throughput, %
    "sm__warps_active.avg.pct_of_peak_sustained_active",  # achieved occupancy
    "launch__registers_per_thread",
)


class NcuCsvError(ValueError):
    pass


def number(text: str):
    """'1,048,576' -> 1048576, '12.5' -> 12.5; anything else (``n/a``, names) stays a string."""
    t = text.strip().replace(",", "")
    try:
        v = float(t)
    except ValueError:
        return text.strip()
    return int(v) if v.is_integer() and "." not in t and "e" not in t.lower() else v


def parse_raw(text: str) -> tuple[list[str], list[str], list[dict]]:
    """(column names, units, one dict per launch) of a raw-page CSV."""
    rows = list(csv.reader(io.StringIO(text)))
    start = next((i for i, r in enumerate(rows) if r and r[0] == "ID"), None)
    if start is None:
        first = next((ln for ln in text.splitlines() if ln.strip()), "")
        raise NcuCsvError(f"no header row starting with \"ID\" in ncu's CSV (first line: {first[:120]!r})")
    header = rows[start]
    if len(rows) < start + 2 or len(rows[start + 1]) != len(header) or rows[start + 1][0] != "":
        raise NcuCsvError("ncu's CSV has no units row under its header (was --print-units base given?)")
    units = rows[start + 1]
    launches = []
    for r in rows[start + 2:]:
        if not r or r[0].startswith("=="):
            continue
        if len(r) != len(header):
            raise NcuCsvError(f"ncu CSV row with {len(r)} fields, header has {len(header)}: {r[:3]}")
        launches.append(dict(zip(header, r, strict=True)))
    return header, units, launches


def to_long(text: str, range_name: str, repeat: int, metrics=METRICS) -> tuple[list[tuple], list[str]]:
    """Long rows for the launches of one workload range, and notes (metrics absent, instances unassignable).

    Every launch in the CSV lies inside ``range_name`` (ncu ran with ``--nvtx-include`` for it alone).
    ``instance`` (the repetition) is the launch's position over the launches per repetition: it is left
    empty when the launches do not split evenly into ``repeat`` repetitions.
    """
    header, units, launches = parse_raw(text)
    unit_of = dict(zip(header, units, strict=True))
    notes = []
    absent = [m for m in metrics if m not in unit_of]
    if absent:
        notes.append(f"{range_name}: ncu reported no {', '.join(absent)}")
    stack_col = next((c for c in header if "Push/Pop_Range" in c), None)  # present with ncu --nvtx
    if stack_col:
        # the thread's push/pop stack, e.g. '677  "rlkernel:logp-native:none:...:logp-native"  "rlkernel:op..." '
        outside = [r for r in launches if f'"{DOMAIN}:{range_name}:' not in r[stack_col]]
        if outside:
            r = outside[0]
            raise NcuCsvError(f"{len(outside)} launches (first: ID {r['ID']}, {r['Kernel Name']}) are not inside "
                              f"NVTX range {DOMAIN}:{range_name} by ncu's own push/pop stack: {r[stack_col].strip()}")
    else:
        notes.append(f"{range_name}: ncu's CSV has no NVTX push/pop column; ranges taken from --nvtx-include alone")
    launches.sort(key=lambda r: int(number(r["ID"])))
    per = len(launches) // repeat if repeat and len(launches) % repeat == 0 else 0
    if launches and not per:
        notes.append(f"{range_name}: {len(launches)} launches do not split into {repeat} repetitions; "
                     "instance left empty")
    out = []
    for i, r in enumerate(launches):
        instance = i // per if per else ""
        for m in metrics:
            if m in r:
                out.append((range_name, instance, r["Kernel Name"], int(number(r["ID"])), m, unit_of[m],
                            number(r[m])))
    return out, notes


_INT64 = (-2 ** 63, 2 ** 63 - 1)


def _integer(text: str, column: str, line: int, path, empty_ok: bool) -> int | None:
    t = text.strip()
    if t == "" and empty_ok:
        return None
    try:
        v = int(t)
    except ValueError:
        v = None
    if v is None or not _INT64[0] <= v <= _INT64[1]:
        raise NcuCsvError(f"{path}: line {line}: {column} {text[:40]!r} is not a 64-bit integer"
                          f"{' (or empty)' if empty_ok else ''}")
    return v


def read_long(path) -> list[tuple]:
    """The rows of a long-format ``ncu.csv``, read back exactly (text cells as written, no spreadsheet
    neutralising: the analyzer joins on them). ``instance`` is an integer or empty, ``launch`` an integer, both
    within int64; ``value`` a number or None (``n/a``). NcuCsvError (one line naming the file and line) else."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))
    except (OSError, ValueError, csv.Error) as e:
        raise NcuCsvError(f"{path}: not a readable ncu.csv ({str(e).splitlines()[0][:160]})") from None
    if not rows or tuple(rows[0][:len(LONG_COLUMNS)]) != LONG_COLUMNS:
        raise NcuCsvError(f"{path}: ncu.csv columns are {rows[0] if rows else []}, expected {list(LONG_COLUMNS)}")
    out = []
    for line, r in enumerate(rows[1:], start=2):
        if not r:
            continue
        if len(r) < len(LONG_COLUMNS):
            raise NcuCsvError(f"{path}: line {line}: {len(r)} fields, expected {len(LONG_COLUMNS)}")
        rng, instance, kernel, launch, metric, unit, value = r[:len(LONG_COLUMNS)]
        v = number(value)
        out.append((rng, _integer(instance, "instance", line, path, True), kernel,
                    _integer(launch, "launch", line, path, False), metric, unit,
                    float(v) if isinstance(v, (int, float)) else None))
    return out


def write_long(path, rows) -> None:
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(LONG_COLUMNS)
        w.writerows(rows)
    os.replace(tmp, path)
