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

from pipelines import cells, datafiles, report_rows, timeline
from pipelines.durations import fmt_ns
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
    env.filters["breakable"] = cells.breakable
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


def table(df: pd.DataFrame | None, columns: list[str], limit: int = HTML_ROWS, t0: int | None = None,
          short: dict[str, str] | None = None) -> dict:
    """A table as the template draws it: {head: [{label, unit, title, numeric}], rows: [[cell]], total, shown,
    empty (the columns left out, empty in every row)}.
    Each column's cells in one unit (pipelines.cells). A ``kernel`` column beside ``kernel_short`` becomes one
    column showing the short name, the demangled one on demand; ``short`` (demangled -> short name) does the
    same for a ``kernel`` or ``name`` column without its short name beside it."""
    has_short = "kernel" in columns and "kernel_short" in columns
    shown_cols = [c for c in columns if not (has_short and c == "kernel_short")]
    if df is None:
        return {"head": [cells.column(c, [])[0] for c in shown_cols], "rows": [], "total": 0, "shown": 0,
                "empty": []}
    d = df.reindex(columns=columns).head(limit).astype(object)
    d = d.where(d.notna(), None)  # NaN / pd.NA print as empty cells
    # a column empty in every row (ncu_* without an ncu.csv) takes width and says nothing: named in the note
    empty = [c for c in shown_cols if len(d) and d[c].isna().all()]
    shown_cols = [c for c in shown_cols if c not in empty]
    head, body = [], []
    for c in shown_cols:
        h, col_cells = cells.column(c, list(d[c]), t0)
        fulls = list(d[c])
        shorts = list(d["kernel_short"]) if has_short and c == "kernel" else \
            [short.get(v) if isinstance(v, str) else None for v in fulls] if short and c in ("kernel", "name") else None
        if shorts is not None:
            for cell, full, sh in zip(col_cells, fulls, shorts, strict=True):
                if isinstance(full, str) and isinstance(sh, str) and sh != full:
                    cell.update(text=sh, full=full, cls="name")
        head.append(h)
        body.append(col_cells)
    rows = [list(r) for r in zip(*body, strict=True)] if body else []
    return {"head": head, "rows": rows, "total": len(df), "shown": len(rows), "empty": empty}


def trace_zero(tables: dict) -> int | None:
    """The report's t0: the earliest timestamp its tables show (start_ns, end_ns, gap_start_ns)."""
    found = [int(df[c].min()) for df in tables.values() if df is not None for c in cells.TIMESTAMPS
             if c in df.columns and df[c].notna().any()]
    return min(found) if found else None


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
        cvd = node.get("cuda_visible_devices")
        rows.append(("CUDA_VISIBLE_DEVICES", "not set" if cvd is None else str(cvd)))
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
    return {k: {**v, "path": textsafe.scrub_argv([v["path"]])[0]} if isinstance(v, dict) and "path" in v else v
            for k, v in meta.items()}


def render_html(result, tables: dict, compare: pd.DataFrame | None, columns: dict, failures: list[str],
                compare_meta: dict | None = None) -> bytes:
    wl, wl_cols, extras = report_rows.workloads(result)
    view = getattr(result, "phase_view", None)  # the RL-step view (pipelines.phase_view); None for --ranks
    badges = [{"range": r["range"], "verdict": r["verdict"], "instances": int(r["instances"]),
               "mean": r["mean_gpu_busy_ns"], **extras.get(r["range"], {})}
              for _, r in wl.iterrows()] if wl is not None else []
    t0 = trace_zero(tables)
    ks = tables.get("kernel_summary")
    short = dict(zip(ks["kernel"], ks["kernel_short"], strict=True)) if ks is not None else {}
    if compare is not None:  # a kernel only in the baseline has no short name here: the report shortens it
        short = {**{n: cells.short_kernel(n) for n in compare.loc[compare["kind"] == "kernel", "name"]}, **short}
    shown = dict(tables)
    if "bandwidth" in shown:
        shown["bandwidth"] = report_rows.bandwidth_notes(shown["bandwidth"], fmt_ns)
    if "utilization" in shown:
        shown["utilization"] = report_rows.utilization_notes(shown["utilization"], tables.get("gaps"),
                                                             getattr(result, "first_calls", None), fmt_ns)
    cols = {name: [*columns.get(name, list(df.columns) if df is not None else [])]
            + (["note"] if df is not None and "note" in df.columns and df["note"].notna().any() else [])
            for name, df in shown.items()}
    ctx = {
        "title": result.source.run_dir.name if result.source.run_dir else result.source.trace.name,
        "generated": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ"),
        "provenance": provenance(result),
        "env": env_block(result),
        "counts": result.counts,
        "patterns": result.patterns,
        "badges": badges,
        "failures": failures,
        "t0": t0,
        "kernel_bars": bar_chart(tables.get("kernel_summary"), "kernel_short", "total_ns", title="kernel"),
        "range_bars": bar_chart(tables.get("range_summary"), "range", "gpu_busy_ns"),
        "tables": {name: table(df, cols[name], t0=t0) for name, df in shown.items()},
        "workloads": table(wl, wl_cols),
        "compare": table(compare, ["kind", "name", "base_instances", "cur_instances", "base_med_ns", "cur_med_ns",
                                   "delta_pct", "base_verdict", "cur_verdict", "regression"], short=short)
        if compare is not None else None,
        "compare_meta": scrub_sides(compare_meta or {}),
        "timelines": timeline.layouts(getattr(result, "timeline", None), fmt_ns),
        "share_ratio": timeline.SHARE_RATIO,
        "first_calls": table(getattr(result, "first_calls", None),
                             ["range", "instances", "first_dur_ns", "first_proj_ns", "first_busy_ns",
                              "steady_med_dur_ns", "steady_med_proj_ns", "steady_med_busy_ns"]),
        "verdict_order": VERDICT_ORDER,
        "step_view": {"headline": view.headline} if view is not None else None,
        "step_timelines": timeline.layouts(view.timeline, fmt_ns) if view is not None else [],
    }
    return environment().get_template("report.html.j2").render(**ctx).encode()
