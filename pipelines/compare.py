"""--compare: this run against a baseline, per instance (issue 18, item 6).

Totals mislead when the instance counts differ (a kernel that ran 12 times in the baseline and 5 times now reads
-58 % on totals while its per-call time moved 0.6 %), so both sides are compared per instance: their instance
counts and median time per instance (a workload's GPU busy time per repetition; a kernel's duration). Two runs
are comparable when they ran on the same GPU model, with the same workloads and shapes (from their manifests; the
workload ranges found when either has none) and the same kernel set; otherwise the command says why and exits 2,
unless ``--force``, which writes the comparison marked as not comparable. The numbers come from
``queries/compare.sql``; this module decides comparability and writes ``compare.json``.
"""
from __future__ import annotations

import json
import pathlib

import duckdb
import pandas as pd

from pipelines import sql

EXAMPLES = 3  # names quoted in a reason before "..."


def gpu_models(result) -> list[str]:
    return sorted({g.get("name") or "" for g in result.meta.get("gpus") or []})


def workload_shapes(result) -> dict[str, str]:
    """workload name -> its shape as canonical JSON (the manifest's), or '' when only the trace names it."""
    manifest = result.source.manifest or {}
    if manifest.get("workloads"):
        return {w["name"]: json.dumps(w.get("shape") or {}, sort_keys=True) for w in manifest["workloads"]}
    return {str(w): "" for w in result.workloads["workload"]} if result.workloads is not None else {}


def _short_names(result) -> dict[str, str]:
    ks = result.tables["kernel_summary"]
    return dict(zip(ks["kernel"], ks["kernel_short"], strict=True))


def _names(items) -> str:
    items = sorted(items)
    return ", ".join(items[:EXAMPLES]) + (f" (+{len(items) - EXAMPLES} more)" if len(items) > EXAMPLES else "")


def comparability(cur, base) -> list[str]:
    """Why the two runs are not comparable; [] when they are."""
    reasons = []
    g_cur, g_base = gpu_models(cur), gpu_models(base)
    if g_cur != g_base:
        reasons.append(f"GPU {' + '.join(g_base) or 'none recorded'} in the baseline, "
                       f"{' + '.join(g_cur) or 'none recorded'} now")
    w_cur, w_base = workload_shapes(cur), workload_shapes(base)
    if set(w_cur) != set(w_base):
        parts = []
        if set(w_base) - set(w_cur):
            parts.append(f"only in the baseline: {_names(set(w_base) - set(w_cur))}")
        if set(w_cur) - set(w_base):
            parts.append(f"only now: {_names(set(w_cur) - set(w_base))}")
        reasons.append("workloads differ (" + "; ".join(parts) + ")")
    changed = sorted(n for n in set(w_cur) & set(w_base) if w_cur[n] != w_base[n])
    for n in changed:
        reasons.append(f"shape of {n} differs: {w_base[n]} in the baseline, {w_cur[n]} now")
    # Kernels are the demangled names (what compare.sql joins on), quoted by their short names.
    short = {**_short_names(base), **_short_names(cur)}
    k_cur, k_base = set(_short_names(cur)), set(_short_names(base))
    if k_cur != k_base:
        parts = []
        if k_base - k_cur:
            parts.append(f"{len(k_base - k_cur)} only in the baseline: {_names(short[k] for k in k_base - k_cur)}")
        if k_cur - k_base:
            parts.append(f"{len(k_cur - k_base)} only now: {_names(short[k] for k in k_cur - k_base)}")
        reasons.append("kernel sets differ (" + "; ".join(parts) + ")")
    return reasons


def frame(cur, base, threshold: float) -> pd.DataFrame:
    """compare.sql over the two runs' workload and kernel summaries."""
    con = duckdb.connect(":memory:")
    for prefix, r in (("cur", cur), ("base", base)):
        con.register(f"{prefix}_workloads", r.workloads)
        con.register(f"{prefix}_kernels", r.tables["kernel_summary"])
    return con.execute(sql.text("compare"), {"threshold": threshold}).df()


def describe(result, path: pathlib.Path) -> dict:
    """How the report names a side: its path, when it was recorded, on which GPU."""
    m = result.source.manifest or {}
    p = result.source.provenance or {}
    return {"path": str(path), "recorded_at": p.get("recorded_at") or m.get("created_at")
            or result.meta.get("EXPORT_TIME_UTC") or "unknown", "gpu": " + ".join(gpu_models(result)) or "unknown"}


def _records(df: pd.DataFrame, kind: str) -> list[dict]:
    cols = ["name", "base_instances", "cur_instances", "base_med_ns", "cur_med_ns", "delta_pct", "base_verdict",
            "cur_verdict", "regression"]
    rows = df[df["kind"] == kind][cols].astype(object).where(df[df["kind"] == kind][cols].notna(), None)
    out = []
    for r in rows.to_dict("records"):
        for k in ("base_instances", "cur_instances"):
            r[k] = None if r[k] is None else int(r[k])
        for k in ("base_med_ns", "cur_med_ns", "delta_pct"):
            r[k] = None if r[k] is None else float(r[k])
        r["regression"] = bool(r["regression"])
        if kind == "kernel":
            r.pop("base_verdict"), r.pop("cur_verdict")
        out.append(r)
    return out


def to_json(cmp: pd.DataFrame, meta: dict) -> bytes:
    """compare.json for CI: the verdict on comparability, and per workload and kernel both sides' instances and
    median per-instance time, the delta and whether it is a regression."""
    doc = {**meta, "workloads": _records(cmp, "workload"), "kernels": _records(cmp, "kernel"),
           "regressions": int(cmp["regression"].sum())}
    return (json.dumps(doc, indent=1) + "\n").encode()
