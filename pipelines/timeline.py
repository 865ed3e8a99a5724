"""The report's timeline (issue 18, item 5): one steady-state repetition per workload as inline SVG, no script.

The items come from ``queries/timeline.sql`` (the repetition with the median GPU busy time, its NVTX ranges, GPU
operations, host syncs and idle gaps); this module only lays them out: NVTX ranges one row per nesting level,
then a row of host syncs, then the GPU row with idle time shaded under the operations. Every shape carries a
``<title>`` (the browser's tooltip) with its name and duration.
"""
from __future__ import annotations

import math

import pandas as pd

WIDTH, LABEL_W, ROW_H, GAP = 900, 210, 16, 4
PLOT_X0, PLOT_W = LABEL_W + 10, WIDTH - LABEL_W - 20
SHARE_RATIO = 25  # a workload's span under 1/25 of the longest on its scale gets a scale of its own
CHAR_W = 6.0  # the width of one character of a range label (10 px system-ui, a little over), in viewBox units
OP_CLASS = {"kernel": "tl-kernel", "memcpy": "tl-memcpy", "memset": "tl-memset", "sync": "tl-sync", "idle": "tl-idle",
            "range": "tl-range"}


def nice_step(scale: float, target: int = 5) -> float:
    """A 1-2-5 step that cuts ``scale`` into about ``target`` parts."""
    raw = scale / target
    mag = 10 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)


def shared_scales(spans: dict[str, int]) -> dict[str, int]:
    """Each workload's time scale: one for all of them, unless a span is under 1/SHARE_RATIO of the longest one
    on its scale (a 73 µs op beside a 68 ms training step would be a sliver): then the shorter ones share a scale
    of their own, and so on down."""
    scales, top = {}, None
    for name, span in sorted(spans.items(), key=lambda kv: -kv[1]):
        if top is None or top > SHARE_RATIO * span:
            top = span
        scales[name] = top
    return scales


def layouts(items: pd.DataFrame | None, fmt_ns) -> list[dict]:
    """Per workload: {name, span_ns, scale_ns, height, rows: [(y, label)], rects: [{x, y, w, h, cls, title}],
    labels: [{x, y, text}], ticks: [{x, label}]}. The workloads on one time scale (the longest repetition's
    span), so that their lengths compare, unless their spans differ by more than SHARE_RATIO (shared_scales);
    a range's name goes inside its box, else beside it where the row is
    free, else (the domain dropped) in the shorter form, else only in its tooltip: never cut."""
    if items is None or items.empty:
        return []
    groups = list(items.groupby("workload", sort=True))
    spans = {name: max(int(df.end_ns.max()) - int(df.start_ns.min()), 1) for name, df in groups}
    scales = shared_scales(spans)
    out = []
    for name, df in groups:
        t0, t1 = int(df.start_ns.min()), int(df.end_ns.max())
        scale = scales[name]
        step = nice_step(scale)
        ticks = [{"x": round(PLOT_X0 + PLOT_W * k * step / scale, 2), "label": fmt_ns(k * step)}
                 for k in range(int(scale // step) + 1)]

        def x(t, t0=t0, scale=scale):
            return PLOT_X0 + PLOT_W * (t - t0) / scale

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
        out.append({"name": name, "span_ns": t1 - t0, "scale_ns": scale, "height": gpu_y + ROW_H + GAP + 14,
                    "rows": rows, "rects": rects, "labels": place_labels(rects), "ticks": ticks,
                    "plot_h": gpu_y + ROW_H, "axis_y": gpu_y + ROW_H + GAP + 10})
    return out


def place_labels(rects: list[dict]) -> list[dict]:
    """Range names placed without cutting them: inside the box when it fits, else right or left of it where its
    row holds no other box or name, trying the full name, then the name without its domain (``op.logp.forward``)."""
    taken: dict[int, list[tuple[float, float]]] = {}
    for r in rects:
        if r["label"]:
            taken.setdefault(r["y"], []).append((r["x"], r["x"] + r["w"]))
    labels = []
    for r in sorted((r for r in rects if r["label"]), key=lambda r: (r["y"], -r["w"])):
        row = taken[r["y"]]
        others = [iv for iv in row if iv != (r["x"], r["x"] + r["w"])]
        for text in dict.fromkeys((r["label"], r["label"].split(":", 1)[-1])):
            tw = CHAR_W * len(text)
            spots = [(r["x"] + 3, r["x"] + 3 + tw, r["x"] + r["w"])]  # inside: must end within the box
            spots += [(r["x"] + r["w"] + 3, r["x"] + r["w"] + 3 + tw, WIDTH - 2),  # right of it
                      (r["x"] - 3 - tw, r["x"] - 3, r["x"])]  # left of it
            spot = next(((a, b) for i, (a, b, limit) in enumerate(spots)
                         if b <= limit - (3 if i == 0 else 0) and a >= PLOT_X0 and
                         not any(a < hi and lo < b for lo, hi in (others if i == 0 else row))), None)
            if spot:
                labels.append({"x": round(spot[0], 2), "y": r["y"] + 10, "text": text})
                if spot[0] < r["x"] or spot[0] >= r["x"] + r["w"]:
                    row.append(spot)
                break
    return labels
