"""The report's timeline (issue 18, item 5): one steady-state repetition per workload as inline SVG, no script.

The items come from ``queries/timeline.sql`` (the repetition with the median GPU busy time, its NVTX ranges, GPU
operations, host syncs and idle gaps); this module only lays them out: NVTX ranges one row per nesting level,
then a row of host syncs, then the GPU row with idle time shaded under the operations. Every shape carries a
``<title>`` (the browser's tooltip) with its name and duration.
"""
from __future__ import annotations

import pandas as pd

WIDTH, LABEL_W, ROW_H, GAP = 900, 210, 16, 4
PLOT_X0, PLOT_W = LABEL_W + 10, WIDTH - LABEL_W - 20
OP_CLASS = {"kernel": "tl-kernel", "memcpy": "tl-memcpy", "memset": "tl-memset", "sync": "tl-sync", "idle": "tl-idle",
            "range": "tl-range"}


def layouts(items: pd.DataFrame | None, fmt_ns) -> list[dict]:
    """Per workload: {name, span_ns, height, rows: [(y, label)], rects: [{x, y, w, h, cls, title}]}."""
    if items is None or items.empty:
        return []
    out = []
    for name, df in items.groupby("workload", sort=True):
        t0, t1 = int(df.start_ns.min()), int(df.end_ns.max())
        span = max(t1 - t0, 1)

        def x(t, t0=t0, span=span):
            return PLOT_X0 + PLOT_W * (t - t0) / span

        lanes = int(df.loc[df.kind == "range", "lane"].max()) + 1 if (df.kind == "range").any() else 0
        rows = [(ROW_H * i + GAP, f"NVTX level {i + 1}") for i in range(lanes)]
        sync_y = ROW_H * lanes + GAP
        gpu_y = sync_y + ROW_H + GAP
        rows += [(sync_y, "host syncs"), (gpu_y, "GPU")]
        rects = []
        for r in df.sort_values(["kind", "start_ns"]).itertuples(index=False):
            y = {"range": ROW_H * int(r.lane) + GAP, "sync": sync_y}.get(r.kind, gpu_y)
            h = ROW_H - 3 if r.kind != "idle" else ROW_H - 1
            rects.append({"x": round(x(r.start_ns), 2), "y": y, "w": round(max(x(r.end_ns) - x(r.start_ns), 0.6), 2),
                          "h": h, "cls": OP_CLASS.get(r.kind, "tl-kernel"),
                          "title": f"{r.label}: {fmt_ns(r.end_ns - r.start_ns)}", "label": r.label if r.kind ==
                          "range" else ""})
        # Idle shading first, so the operations draw over it.
        rects.sort(key=lambda q: q["cls"] != "tl-idle")
        out.append({"name": name, "span_ns": span, "height": gpu_y + ROW_H + GAP + 14, "rows": rows, "rects": rects,
                    "axis_y": gpu_y + ROW_H + GAP + 10})
    return out
