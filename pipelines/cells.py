"""The HTML tables' cells: each column's numbers in one unit a person reads (the CSVs keep the raw values).

The kind of a column comes from its name (the CSV contract's names, docs/trace-schema.md): ``*_ns`` durations get
one unit per column (ns, µs, ms or s, from the column's median) so that their magnitudes compare down the column;
timestamps (``start_ns``, ``end_ns``, ``gap_start_ns``) are shown from the report's t = 0; ``session_start_ns``
from the earliest rank's; ids (pid, rank, instance) print without thousands separators; booleans as yes/no. Every
converted cell keeps its raw value in its ``title`` (the tooltip), as the CSV has it.

Pure functions of the values: no Jinja, no I/O (pipelines.report renders what they return).
"""
from __future__ import annotations

import math
import numbers
import re

import markupsafe

from rlkernel import textsafe

TIMESTAMPS = frozenset({"start_ns", "end_ns", "gap_start_ns"})
CLOCKS = frozenset({"session_start_ns"})  # UTC ns: shown from the earliest row's
IDS = frozenset({"pid", "device_id", "device", "rank", "instance", "gap_rank", "slowest_rank", "busiest_rank",
                 "launch"})
RATIOS = frozenset({"spread", "busy_imbalance"})
BYTES = frozenset({"bytes", "ncu_dram_bytes", "peak_memory_bytes"})
SI = {"tokens_per_s": "tokens/s"}  # column -> unit; SI prefixes per column
VERDICTS = frozenset({"verdict", "base_verdict", "cur_verdict"})
# Names a reader scans down a column: monospace, on one line (one longer than LONG_NAME wraps after punctuation)
NAMES = frozenset({"range", "workload", "name", "kernel", "kernel_short", "source", "label"})

LONG_NAME = 48  # a name longer than this may wrap (after punctuation); a shorter one stays on one line
_DURATION_UNITS = (("s", 1e9), ("ms", 1e6), ("µs", 1e3), ("ns", 1.0))
_SI_PREFIXES = (("G", 1e9), ("M", 1e6), ("k", 1e3), ("", 1.0))
_BREAK_AFTER = re.compile(r"([:/_(<>\[\]]|[.,](?![\d\s]))")  # not in a number (1.05, 10,882) nor before a space


def is_number(v) -> bool:
    return isinstance(v, numbers.Number) and not is_bool(v) and not (isinstance(v, float) and math.isnan(v))


def is_bool(v) -> bool:
    return type(v).__name__ in ("bool", "bool_")  # Python's and numpy's


def breakable(text) -> markupsafe.Markup:
    """Escaped, control characters shown, with a line-break opportunity (<wbr>) after punctuation: a long name
    wraps at ``:`` ``.`` ``_`` ``,`` ``(`` ``<`` and never inside a word."""
    parts = _BREAK_AFTER.split(textsafe.visible(str(text)))
    out = markupsafe.Markup("")
    for i, p in enumerate(parts):
        out += markupsafe.escape(p)
        if i % 2:  # a separator
            out += markupsafe.Markup("<wbr>")
    return out


def short_kernel(name: str) -> str:
    """A demangled kernel name's function name (``void at::native::reduce_kernel<...>(T3)`` -> ``reduce_kernel``):
    for a kernel the report has no nsys short name of (one only in a --compare baseline). Not nsys's rule, only
    close to it: the last ``::`` part before the first template or parameter list."""
    text = name.replace("<unnamed>::", "").replace("(anonymous namespace)::", "").removeprefix("void ")
    cut = min((i for i in (text.find("<"), text.find("(")) if i > 0), default=len(text))
    head = text[:cut]
    return head.rsplit("::", 1)[-1].strip() or name


def sig3(x: float) -> str:
    """About three significant digits, never an exponent: 272,811 / 64.3 / 3.65 / 0.0421."""
    a = abs(x)
    if a == 0:
        return "0"
    if a >= 100:
        return f"{x:,.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.2f}"
    return f"{x:.{min(6, 2 - math.floor(math.log10(a)))}f}".rstrip("0").rstrip(".")


def _median(values: list[float]) -> float:
    v = sorted(abs(x) for x in values if x)
    if not v:
        return 0.0
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def _pick(values: list[float], units) -> tuple[str, float]:
    m = _median(values)
    return next(((u, s) for u, s in units if m >= s), units[-1])


def kind_of(col: str) -> str:
    if col in VERDICTS:
        return "verdict"
    if col in TIMESTAMPS:
        return "time"
    if col in CLOCKS:
        return "clock"
    if col.endswith("_ns"):
        return "duration"
    if col in IDS:
        return "id"
    if col in RATIOS:
        return "ratio"
    if col in BYTES:
        return "bytes"
    if col in SI:
        return "si"
    if col.endswith("_pct") or col.startswith("pct_"):
        return "pct"
    return "plain"


def column(col: str, values: list, t0: int | None = None) -> tuple[dict, list[dict]]:
    """One column's header and cells: ({label, unit, title, numeric}, [{text, cls, title, pill, full, wrap}]).
    ``t0``: the report's zero for timestamps (default: the column's earliest)."""
    kind = kind_of(col)
    nums = [v for v in values if is_number(v)]
    numeric = bool(nums) and all(v is None or is_number(v) for v in values)
    label, unit, note, base, scale, fmt = col, "", "", 0, 1.0, None
    if not numeric:
        kind = "verdict" if kind == "verdict" else "plain"  # text in a column a number's name would suggest
    if kind == "duration":
        label, fmt = col[:-3], sig3
        unit, scale = _pick(nums, _DURATION_UNITS)
    elif kind in ("time", "clock"):
        base = (t0 if t0 is not None else min(nums)) if kind == "time" else min(nums)
        top = max(abs(v - base) for v in nums)
        label, scale = col[:-3], 1e9 if top >= 100e9 else 1e6
        unit = ("s" if scale == 1e9 else "ms") + (" from t0" if kind == "time" else " after the earliest")
        note = f"t0 = {base:,} ns on the trace's clock" if kind == "time" else \
            f"the earliest: {base:,} ns since the UTC epoch"

        def fmt(x):
            return f"{x:,.3f}"
    elif kind in ("bytes", "si"):
        prefix, scale = _pick(nums, _SI_PREFIXES)
        unit, fmt = (f"{prefix}B" if kind == "bytes" else f"{prefix} {SI[col]}".strip()), sig3
    cells = [{"title": "", "pill": "", "full": "", "wrap": False, **_cell(v, col, kind, scale, fmt, base)}
             for v in values]
    title = f"{col} (the CSV's raw value{'; ' + note if note else ''})" if unit else col
    return {"label": label, "unit": unit, "title": title, "numeric": numeric}, cells


def _cell(v, col: str, kind: str, scale: float, fmt, base) -> dict:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return {"text": "", "cls": ""}
    if kind == "verdict":
        return {"text": str(v), "cls": "", "pill": f"v-{v}"}
    if is_bool(v):
        return {"text": "yes" if v else "no", "cls": "b"}
    if not is_number(v):
        text = str(v)
        long = len(text) > LONG_NAME
        cls = ("name" if col in NAMES else "t") + (" long" if long else "") + (" note" if col == "note" else "")
        return {"text": text, "cls": cls, "wrap": long or col not in NAMES}
    if fmt is not None:
        return {"text": fmt((v - base) / scale), "cls": "n", "title": f"{v:,}"}
    if kind == "id":
        return {"text": str(int(v)) if float(v).is_integer() else str(v), "cls": "n"}
    if kind == "ratio":
        return {"text": f"{v:.3f}", "cls": "n"}
    if kind == "pct":
        return {"text": f"{v:.1f}", "cls": "n"}
    if isinstance(v, float) and not v.is_integer():
        return {"text": f"{v:,.1f}", "cls": "n"}
    return {"text": f"{int(v):,}", "cls": "n"}
