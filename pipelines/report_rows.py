"""What the HTML report adds to the analyzer's rows (the CSVs stay as they are): each workload's shape and dtype,
its fused-vs-native ratio and tokens/s, and a word of explanation beside a figure that looks alarming but is
expected (a bandwidth far below peak on a latency-bound toy shape, a low GPU utilisation that module loading
dominates).

All of it comes from data the report already holds: the run manifest's workloads (name, op, path, shape, dtype;
docs/contracts.md, section 6) and the analysis' tables. Without a manifest the shape columns stay empty, and
a ``*-fused*`` workload is paired with the ``*-native*`` one of the same name.
"""
from __future__ import annotations

import json

import pandas as pd

LATENCY_BOUND_NS = 10_000  # under this ideal time at peak bandwidth, launch latency (a few µs) dominates a kernel
LOW_UTIL_PCT = 50.0  # a GPU utilisation below this gets its reason said beside it
SHAPE_COLS = {"B": "batch_size", "S": "seq_len", "V": "vocab_size", "H": "hidden_size"}


def _positive(v) -> bool:
    return v is not None and bool(pd.notna(v)) and v > 0


def _manifest_workloads(result) -> dict[str, dict]:
    m = result.source.manifest or {}
    return {w["name"]: w for w in m.get("workloads") or [] if isinstance(w, dict) and w.get("name")}


def _counterpart(name: str, spec: dict | None, specs: dict[str, dict], present: set[str]) -> str | None:
    """The native workload a fused one is measured against: the manifest's workload of the same op, shape and
    dtype on the native path; else the same name with ``fused`` -> ``native``."""
    if spec is not None:
        if spec.get("path") != "fused":
            return None
        key = (spec.get("op"), json.dumps(spec.get("shape") or {}, sort_keys=True), spec.get("dtype"))
        for other, s in specs.items():
            if other in present and s.get("path") == "native" and (
                    s.get("op"), json.dumps(s.get("shape") or {}, sort_keys=True), s.get("dtype")) == key:
                return other
        return None
    if "fused" not in name:
        return None
    other = name.replace("fused", "native", 1)
    return other if other in present else None


def workloads(result) -> tuple[pd.DataFrame | None, list[str], dict[str, dict]]:
    """The workloads table as the report shows it, its columns, and per workload range the badge's extras
    ({shape, ratio, versus})."""
    wl = result.workloads
    if wl is None:
        return None, [], {}
    specs = _manifest_workloads(result)
    d = wl.copy()
    busy = dict(zip(d["workload"], d["mean_gpu_busy_ns"], strict=True))
    present = set(busy)
    extras: dict[str, dict] = {}
    for col in ("B", "S", "V", "H", "dtype", "native_over_fused", "tokens_per_s"):
        d[col] = None
    for i, r in d.iterrows():
        spec = specs.get(r["workload"])
        shape = (spec or {}).get("shape") or {}
        for col, key in SHAPE_COLS.items():
            if isinstance(shape.get(key), int):
                d.at[i, col] = shape[key]
        if spec and isinstance(spec.get("dtype"), str):
            d.at[i, "dtype"] = spec["dtype"]
        native = _counterpart(r["workload"], spec, specs, present)
        mine = r["mean_gpu_busy_ns"] if _positive(r["mean_gpu_busy_ns"]) else None
        ratio = float(busy[native]) / mine if native and mine and _positive(busy[native]) else None
        if ratio is not None:
            d.at[i, "native_over_fused"] = round(ratio, 2)
        tokens = shape.get("batch_size", 0) * shape.get("seq_len", 0) if all(
            isinstance(shape.get(k), int) for k in ("batch_size", "seq_len")) else 0
        if tokens and mine:
            d.at[i, "tokens_per_s"] = tokens / (mine / 1e9)
        dims = "×".join(str(shape[k]) for k in ("batch_size", "seq_len", "vocab_size") if isinstance(shape.get(k), int))
        extras[r["range"]] = {"shape": " ".join(x for x in (dims, (spec or {}).get("dtype") or "") if x),
                              "ratio": ratio, "versus": native}
    cols = ["range", "verdict", "B", "S", "V", "H", "dtype", "instances", "fused_kernels", "other_kernels",
            "mean_gpu_busy_ns", "med_gpu_busy_ns", "native_over_fused", "tokens_per_s", "mean_kernel_ns",
            "mean_proj_gpu_ns", "host_syncs", "dtoh_copies"]
    cols = [c for c in cols if c not in ("B", "S", "V", "H", "dtype") or d[c].notna().any()]
    return d, cols, extras


def bandwidth_notes(df: pd.DataFrame | None, fmt_ns) -> pd.DataFrame | None:
    """bandwidth.csv's rows with a ``note`` where % of peak says little: the bytes a repetition must move take
    under LATENCY_BOUND_NS at peak bandwidth, so launch latency, not memory, sets the time."""
    if df is None or df.empty:
        return df
    d = df.copy()
    notes = []
    for r in d.itertuples(index=False):
        ideal = r.bytes / (r.peak_gb_per_s * 1e9) * 1e9 if pd.notna(r.bytes) and pd.notna(r.peak_gb_per_s) \
            and r.peak_gb_per_s else None
        if ideal is not None and ideal < LATENCY_BOUND_NS:
            notes.append(f"latency-bound shape: at peak bandwidth its {r.bytes / 1e6:.3g} MB move in "
                         f"{fmt_ns(ideal)}, less than a kernel launch takes (a few µs), so % of peak is low by "
                         "construction; capture a representative shape for a bandwidth figure")
        else:
            notes.append(None)
    d["note"] = notes
    return d


def utilization_notes(df: pd.DataFrame | None, gaps: pd.DataFrame | None, first_calls: pd.DataFrame | None,
                      fmt_ns) -> pd.DataFrame | None:
    """utilization.csv's rows with a ``note`` where the GPU looks idle: how much of the span the idle gaps of
    more than 1 ms hold, and the slowest first call (module loading, autotuning land there)."""
    if df is None or df.empty:
        return df
    d = df.copy()
    first = None
    if first_calls is not None and not first_calls.empty:
        first = first_calls.sort_values("first_dur_ns", ascending=False).iloc[0]
    notes = []
    for r in d.itertuples(index=False):
        if pd.isna(r.in_use_pct) or r.in_use_pct >= LOW_UTIL_PCT:
            notes.append(None)
            continue
        parts = []
        if gaps is not None and not gaps.empty:
            g = gaps[(gaps["pid"] == r.pid) & (gaps["device_id"] == r.device_id)]
            if len(g) and r.dur_ns:
                parts.append(f"{100 * g['gap_ns'].sum() / r.dur_ns:.0f} % of the {fmt_ns(r.dur_ns)} span is "
                             f"{len(g)} idle gaps of more than 1 ms (GPU idle gaps below)")
        if first is not None and first["first_dur_ns"] > 10 * max(first["steady_med_dur_ns"] or 0, 1):
            parts.append(f"the first call of {first['range']} took {fmt_ns(first['first_dur_ns'])} against "
                         f"{fmt_ns(first['steady_med_dur_ns'])} later (module loading, autotuning)")
        notes.append("low, as expected of a short capture: " + "; ".join(parts) +
                     "; the steady state is in the timeline and the workload rows" if parts else None)
    d["note"] = notes
    return d
