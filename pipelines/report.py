"""Rendering: CSV tables and one self-contained HTML report (Jinja, autoescaped); pipelines.outdir swaps them in
as one directory.

Every string that reaches the HTML passes Jinja's autoescape (kernel names are full of ``<>&``); nothing in
the page loads from the network (inline CSS and SVG). The environment block shows an allow-list of fields
from the run manifest and the export's GPU table; the traced process's environment (TARGET_INFO_SYSTEM_ENV,
META_DATA_CAPTURE's ENVIRONMENT_VARIABLE rows) is never read by the analyzer, so it cannot be shown.
"""
from __future__ import annotations

import datetime
import io
import pathlib

import jinja2
import markupsafe
import pandas as pd

from pipelines import datafiles, timeline
from pipelines.manifest import ENV_ALLOWED
from rlkernel import textsafe

HTML_ROWS = 300  # tables longer than this show their first rows; the CSV has them all
VERDICT_ORDER = ("fallback", "mixed", "no-gpu-work", "native", "fused")


def _template_dir() -> pathlib.Path:
    return datafiles.folder("reports_templates")


def _visible(v):
    return textsafe.visible(v) if isinstance(v, str) and not isinstance(v, markupsafe.Markup) else v


def environment() -> jinja2.Environment:
    # finalize: every string a template prints shows its control characters visibly (textsafe.visible), then
    # autoescape escapes it
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(_template_dir())), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                             finalize=_visible)
    env.filters["ns"] = fmt_ns
    env.filters["num"] = fmt_num
    env.filters["code_spans"] = code_spans
    return env


def code_spans(text) -> markupsafe.Markup:
    """Markdown-style `code` spans of a provenance note as <code>; everything escaped, control characters
    shown. Unbalanced backticks are left as they are."""
    parts = str(text).split("`")
    if len(parts) % 2 == 0:
        return markupsafe.escape(textsafe.visible(str(text)))
    return markupsafe.Markup("").join(
        markupsafe.Markup("<code>{}</code>").format(textsafe.visible(p)) if i % 2 else
        markupsafe.escape(textsafe.visible(p)) for i, p in enumerate(parts))


def fmt_ns(v) -> str:
    """A duration in ns, as a human reads it (the CSVs keep the raw ns)."""
    if v is None or (isinstance(v, float) and v != v):
        return ""
    v = float(v)
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.3g} {unit}"
    return f"{v:.0f} ns"


def fmt_num(v) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return ""
    if isinstance(v, float) and not v.is_integer():
        return f"{v:,.1f}"
    try:
        return f"{int(v):,}"
    except (TypeError, ValueError):
        return str(v)


def csv_bytes(df: pd.DataFrame, columns: list[str]) -> bytes:
    """The table as CSV, text cells neutralised for spreadsheets (rlkernel.textsafe.to_spreadsheet)."""
    buf = io.StringIO()
    d = df.reindex(columns=columns)
    for c in d.columns:
        if d[c].dtype == object or pd.api.types.is_string_dtype(d[c]):
            d[c] = d[c].map(textsafe.to_spreadsheet)
        elif _integral_floats(d[c]):
            d[c] = d[c].astype("Int64")  # a count with NULLs comes out of DuckDB as float: 30, not 30.0
    d.to_csv(buf, index=False, lineterminator="\r\n")  # a cell holding a bare CR quoted: textsafe.lf_row_ends
    return textsafe.lf_row_ends(buf.getvalue()).encode()


def _integral_floats(col: pd.Series) -> bool:
    if not pd.api.types.is_float_dtype(col):
        return False
    v = col.dropna()
    return bool(len(v)) and bool(((v % 1 == 0) & (v.abs() < 2 ** 53)).all())


def table(df: pd.DataFrame | None, columns: list[str], limit: int = HTML_ROWS) -> dict:
    if df is None:
        return {"columns": columns, "rows": [], "total": 0, "shown": 0}
    d = df.reindex(columns=columns).head(limit).astype(object)
    rows = d.where(d.notna(), None).to_dict("records")  # NaN / pd.NA print as empty cells
    return {"columns": columns, "rows": rows, "total": len(df), "shown": len(rows)}


def bar_chart(df: pd.DataFrame | None, label: str, value: str, title: str | None = None, top: int = 12) -> list[dict]:
    """Bars for the SVG chart: the top rows by value and one 'others' bar for the rest. Labels that repeat
    (one short name, several template instances) get [2], [3]...; the full name is the bar's tooltip."""
    if df is None or df.empty:
        return []
    d = df[df[value] > 0].sort_values(value, ascending=False)  # no zero-length bars
    if d.empty:
        return []
    head, rest = d.head(top), d.iloc[top:]
    bars, seen = [], {}
    for _, r in head.iterrows():
        name = str(r[label])
        seen[name] = seen.get(name, 0) + 1
        shown = name if seen[name] == 1 else f"{name} [{seen[name]}]"
        bars.append({"label": shown, "title": str(r[title or label]), "value": float(r[value])})
    if len(rest):
        bars.append({"label": f"{len(rest)} others", "title": f"{len(rest)} others", "value": float(rest[value].sum())})
    peak = max((b["value"] for b in bars), default=0) or 1.0
    total = sum(b["value"] for b in bars) or 1.0
    for b in bars:
        b["frac"] = b["value"] / peak
        b["pct"] = 100.0 * b["value"] / total
    return bars


def env_block(result) -> list[tuple[str, str]]:
    """(label, value) pairs: where the trace was recorded. Allow-listed fields only."""
    m = result.source.manifest or {}
    node = m.get("node") or {}
    tools = m.get("tools") or {}
    meta = result.meta
    rows: list[tuple[str, str]] = []
    for g in meta.get("gpus", []):
        cc = f"{g['cc_major']}.{g['cc_minor']}" if g.get("cc_major") is not None else ""
        bw = g.get("memory_bandwidth_bytes_per_s")
        rows.append((f"GPU {g['id']}", f"{g['name']} (compute capability {cc}, {g.get('sm_count')} SMs"
                     + (f", {bw / 1e9:.0f} GB/s peak memory bandwidth" if bw else "") + ")"))
    for key, label in (("driver", "driver"), ("cuda_runtime", "CUDA runtime"), ("torch", "torch"),
                       ("python", "python")):
        if node.get(key):
            rows.append((label, str(node[key])))
    if "cuda_visible_devices" in node:
        rows.append(("CUDA_VISIBLE_DEVICES", str(node.get("cuda_visible_devices"))))
    for d in node.get("devices") or []:
        if d.get("index", -1) >= 0:
            rows.append((f"cuda:{d.get('index')}", f"physical GPU {d.get('physical_index')} {d.get('uuid', '')} "
                         f"{d.get('name', '')}"))
    ext = node.get("extension")
    if isinstance(ext, dict):
        rows.append(("rlkernel extension", "built " + ", ".join(ext.get("archs") or []) if ext.get("built")
                     else f"not built ({ext.get('reason', '')})"))
    for name in ("nsys", "ncu"):
        t = tools.get(name)
        if isinstance(t, dict) and t.get("version"):
            rows.append((name, str(t["version"])))
    if meta.get("EXPORT_PRODUCT_VERSION"):
        rows.append(("exported by", f"{meta.get('EXPORT_PRODUCT_NAME', 'nsys')} {meta['EXPORT_PRODUCT_VERSION']}"))
    shown = {label for label, _ in rows}
    for k, v in sorted((m.get("env") or {}).items()):
        if k in ENV_ALLOWED and k not in shown:  # CUDA_VISIBLE_DEVICES comes from the node record too
            rows.append((k, str(v)))
    # the extension's failure reason names the .so it could not load, in the user's site-packages
    return [(label, textsafe.scrub_paths(value, spaces=True)) for label, value in rows]


def provenance(result) -> dict:
    """Where and when: the bundled example's record, else the manifest, else the export's own metadata."""
    m = result.source.manifest or {}
    p = dict(result.source.provenance or {})
    gpus = result.meta.get("gpus") or []
    out = {
        "recorded_at": p.get("recorded_at") or m.get("created_at") or result.meta.get("EXPORT_TIME_UTC") or "unknown",
        "where": p.get("where") or p.get("gpu") or (gpus[0]["name"] if gpus else ""),
        "note": str(p.get("note", "")).rstrip().rstrip("."),  # the template ends the sentence
        "command": textsafe.scrub_command(m["command"]) if m.get("command") else p.get("command", ""),
    }
    # A run's command holds the user's absolute paths (interpreter, --output-dir): shown as the stripped
    # fixtures show them, <path>/<basename>.
    return {k: textsafe.scrub_paths(str(v)) for k, v in out.items()}


def scrub_sides(meta: dict) -> dict:
    """--compare's metadata as the report shows it: each side's path as ``<path>/<basename>`` (compare.json keeps
    them as given)."""
    return {k: {**v, "path": textsafe.scrub_argument(v["path"])} if isinstance(v, dict) and "path" in v else v
            for k, v in meta.items()}


def render_html(result, tables: dict, compare: pd.DataFrame | None, columns: dict, failures: list[str],
                compare_meta: dict | None = None) -> bytes:
    wl = result.workloads
    badges = [{"range": r["range"], "verdict": r["verdict"], "instances": int(r["instances"]),
               "mean": r["mean_gpu_busy_ns"]} for _, r in wl.iterrows()] if wl is not None else []
    ctx = {
        "title": result.source.run_dir.name if result.source.run_dir else result.source.trace.name,
        "generated": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ"),
        "provenance": provenance(result),
        "env": env_block(result),
        "counts": result.counts,
        "patterns": result.patterns,
        "badges": badges,
        "failures": failures,
        "kernel_bars": bar_chart(tables.get("kernel_summary"), "kernel_short", "total_ns", title="kernel"),
        "range_bars": bar_chart(tables.get("range_summary"), "range", "gpu_busy_ns"),
        "tables": {name: table(df, columns.get(name, list(df.columns) if df is not None else []))
                   for name, df in tables.items()},
        "workloads": table(wl, ["range", "verdict", "instances", "fused_kernels", "other_kernels",
                                "mean_gpu_busy_ns", "med_gpu_busy_ns", "mean_kernel_ns", "mean_proj_gpu_ns",
                                "host_syncs", "dtoh_copies"]),
        "compare": table(compare, ["kind", "name", "base_instances", "cur_instances", "base_med_ns", "cur_med_ns",
                                   "delta_pct", "base_verdict", "cur_verdict", "regression"])
        if compare is not None else None,
        "compare_meta": scrub_sides(compare_meta or {}),
        "timelines": timeline.layouts(getattr(result, "timeline", None), fmt_ns),
        "first_calls": table(getattr(result, "first_calls", None),
                             ["range", "instances", "first_dur_ns", "first_proj_ns", "first_busy_ns",
                              "steady_med_dur_ns", "steady_med_proj_ns", "steady_med_busy_ns"]),
        "verdict_order": VERDICT_ORDER,
    }
    return environment().get_template("report.html.j2").render(**ctx).encode()
