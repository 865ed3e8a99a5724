"""`analyze --ranks DIR`, the reduce side: the ranks' Parquet partials unioned with DuckDB, the cross-rank table
(``queries/cross_rank.sql``), the RL phases across ranks (``queries/cross_rank_phases.sql``), and the outputs:
every single-trace CSV with a leading ``rank`` column (the union of the per-rank tables; steps.csv and phases.csv
too where the ranks have RL phases), ``ranks.csv``, ``cross_rank.csv``, ``phases_cross_rank.csv`` and one HTML
report (reports_templates/cross_rank.html.j2).
"""
from __future__ import annotations

import dataclasses
import datetime
import pathlib
import tempfile

import duckdb
import pandas as pd

from pipelines import analysis, phase_view, ranks, report, sql, trace_db

COLUMNS = ["range", "rank", "instances", "range_total_ns", "span_ns", "busy_ns", "start_offset_ns", "verdict",
           "required_fused", "comm_ns", "compute_ns", "overlap_ns", "slowest_rank", "spread", "fused_all_ranks",
           "busy_imbalance"]
RANK_COLUMNS = ["rank", "source", "pid", "device", "session_start_ns", "kernels", "memory_ops", "ranges"]
PHASE_COLUMNS = ["name", "phase", "rank", "instances", "total_ns", "med_ns", "step_share_pct", "gpu_busy_ns",
                 "busy_pct", "host_syncs", "syncs_per_step", "logprob_by", "logprob_ns", "slowest_rank", "spread",
                 "busiest_rank", "busy_imbalance"]
SUMMARY_COLUMNS = ["range", "ranks_with_range", "slowest_rank", "spread", "busiest_rank", "busy_imbalance",
                   "fused_all_ranks", "verdicts"]
CLOCK_NOTE = ("Each rank's times are placed on one host clock: its trace's timestamps plus the trace's "
              "TARGET_INFO_SESSION_START_TIME (the UTC time of its zero). Ranks split from one export share one "
              "session and so one clock; ranks recorded on several hosts are only as aligned as their clocks.")


@dataclasses.dataclass
class Reduced:
    ranks: pd.DataFrame  # one row per rank (RANK_COLUMNS)
    tables: dict[str, pd.DataFrame]  # the single-trace tables, unioned, with a leading rank column
    cross: pd.DataFrame  # cross_rank.csv
    infos: list[dict]
    phases: pd.DataFrame | None = None  # phases_cross_rank.csv; None: no rank has RL phases


def _union(con, paths: list[pathlib.Path]) -> pd.DataFrame:
    # the file names are our own temporary files; read_parquet takes the list as a parameter
    return con.execute("SELECT * EXCLUDE (_row) FROM read_parquet(?, union_by_name = true) ORDER BY rank, _row",
                       [[p.as_posix() for p in paths]]).df()


def reduce(partials: list[ranks.RankPartial]) -> Reduced:
    partials = sorted(partials, key=lambda p: p.rank)
    con = duckdb.connect(":memory:")
    with tempfile.TemporaryDirectory(prefix="rlkernel-ranks-") as d:
        files: dict[str, list[tuple[pathlib.Path, int]]] = {}
        for p in partials:
            for name, data in p.parquet.items():
                path = pathlib.Path(d) / f"rank{p.rank}-{name}.parquet"
                path.write_bytes(data)
                files.setdefault(name, []).append((path, p.info["rows"][name]))
        tables = {}
        for name, found in files.items():
            # a rank with no rows has no column types of its own (object columns): it adds nothing to the union
            paths = [path for path, n in found if n] or [found[0][0]]
            tables[name] = _union(con, paths)
    rank_list = pd.DataFrame({"rank": [p.rank for p in partials],
                              "session_start_ns": pd.array([p.info["session_start_ns"] for p in partials],
                                                           dtype="Int64")})
    con.register("rank_list", rank_list)
    con.register("rank_ranges", tables.pop("cross_rank"))
    try:
        cross = con.execute(sql.text("cross_rank")).df()
    except trace_db.NUMERIC_ERRORS as e:
        # one host clock is each trace's time plus its session start: an extreme start (INT64_MAX or MIN) overflows
        # there or in the offsets from the earliest rank. Name the rank whose start is farthest from zero.
        worst = max(partials, key=lambda p: abs(p.info["session_start_ns"] or 0))
        raise trace_db.out_of_range(pathlib.Path(worst.info["trace"]), e) from None
    phases = None
    if "phases" in tables and len(tables["phases"]):
        rank_phases = tables["phases"].copy()
        rank_phases["ord"] = rank_phases.groupby("rank").cumcount()  # phases.csv's order, per rank
        con.register("rank_phases", rank_phases)
        phases = con.execute(sql.text("cross_rank_phases")).df()
    rows = [{"rank": p.rank, "source": p.info["source"], "pid": p.info["pid"], "device": p.info["device"],
             "session_start_ns": p.info["session_start_ns"], **p.info["counts"]} for p in partials]
    return Reduced(pd.DataFrame(rows, columns=RANK_COLUMNS), tables, cross, [p.info for p in partials], phases)


def check_phase_names(red: Reduced, phases: list[str], step_range: str | None) -> None:
    """phase_view.PhaseError for a --phase or --step-range name no rank has (each rank's map step let it pass)."""
    summ = red.tables.get("range_summary")
    names = sorted(set(summ["range"])) if summ is not None and len(summ) else []
    messages = sorted({n.split(":", 1)[1] for n in names if ":" in n})  # `domain:message`: the closest by message
    phase_view.check_names(names, phases, step_range, messages, where="any rank")


def phase_lines(red: Reduced) -> list[str]:
    """The terminal's RL-step lines: each rank's headline, then the phase (the step apart) whose busiest rank is
    furthest above the median rank."""
    lines = [f"  rank {i['rank']}: {i['headline']}" for i in red.infos if i.get("headline")]
    p = red.phases
    if p is not None and len(p):
        inner = p[p["phase"].notna() & ~p["phase"].str.endswith(":" + phase_view.PHASE_PREFIX + phase_view.STEP_NAME)]
        inner = inner[inner["busy_imbalance"].notna()]
        if len(inner):
            r = inner.sort_values(["busy_imbalance", "name"], ascending=[False, True]).iloc[0]
            lines.append(f"  phase {r['name']}: busiest rank {int(r['busiest_rank'])} (busy imbalance "
                         f"{r['busy_imbalance']:.3f}), slowest rank {int(r['slowest_rank'])} (spread "
                         f"{r['spread']:.3f}); per rank in phases_cross_rank.csv")
    return lines


def failures(red: Reduced) -> list[str]:
    """--require-fused across ranks: every rank's own failures, and a range that must be fused on some rank but
    is missing on another (its fused claim cannot hold there)."""
    bad = [f"rank {i['rank']}: {f}" for i in red.infos for f in i["failures"]]
    c = red.cross
    required = set(c.loc[c["required_fused"].fillna(False).astype(bool), "range"])
    for r in c[c["range"].isin(required) & (c["instances"] == 0)].itertuples(index=False):
        bad.append(f"rank {r.rank}: {r.range}: absent (required fused on another rank)")
    return bad


def sync_failures(red: Reduced) -> list[str]:
    """--require-no-sync across ranks: every rank's own held host syncs (each rank's map step lists them)."""
    return [f"rank {i['rank']}: {f}" for i in red.infos for f in i["sync_failures"]]


NOT_JUDGED = "no verdict (verdicts judge workload and op ranges only)"
COMM_NOTE = ("comm_ns is 0 on every rank: no kernel matches {patterns}. A gloo job's collectives run on the CPU, so "
             "their time is in the ranges' spans, not on the GPU.")
STRAGGLER = 1.1  # a busy imbalance from this up names the busiest rank as a straggler in the report's first line
HEADLINE_OTHERS = 5  # ranges without a verdict named on the terminal, the most imbalanced first


def summary(cross: pd.DataFrame) -> pd.DataFrame:
    """One row per range: how many ranks have it, the slowest one (span) and the spread, the busiest one (GPU
    busy time) and the busy imbalance, and the verdicts in words."""
    rows = []
    for rng, g in cross.groupby("range", sort=False):
        judged = g[g["verdict"].notna()]
        kinds = judged["verdict"].unique()
        if len(kinds) == 1 and len(judged) == len(g):
            words = f"{kinds[0]} on all {len(g)} ranks"
        else:
            words = ", ".join(f"rank {r.rank} {r.verdict if isinstance(r.verdict, str) else 'absent'}"
                              for r in g.itertuples(index=False)) if len(judged) else NOT_JUDGED
        first = g.iloc[0]
        busy = g[g["busy_ns"].fillna(0) > 0]
        # the rank column's own value (a row read whole goes through float64)
        busiest = int(busy.sort_values(["busy_ns", "rank"], ascending=[False, True])["rank"].iloc[0]) \
            if len(busy) else None
        rows.append({"range": rng, "ranks_with_range": int((g["instances"].fillna(1) > 0).sum()),
                     "slowest_rank": first["slowest_rank"], "spread": first["spread"], "busiest_rank": busiest,
                     "busy_imbalance": first["busy_imbalance"], "fused_all_ranks": first["fused_all_ranks"],
                     "verdicts": words, "judged": bool(len(judged))})
    out = pd.DataFrame(rows, columns=[*SUMMARY_COLUMNS, "judged"])
    # from the Python ints, not the float64 column pandas made of ints and None (rank 2^63 - 1 would not survive)
    out["busiest_rank"] = pd.array([r["busiest_rank"] for r in rows], dtype="Int64")
    return out


def no_comm_kernels(cross: pd.DataFrame) -> bool:
    return bool(len(cross)) and bool((cross["comm_ns"].fillna(0) == 0).all())


def headline(summ: pd.DataFrame) -> list[str]:
    """The terminal's lines: the whole trace and every judged range, then the other ranges with the largest busy
    imbalance (HEADLINE_OTHERS of them). The busy imbalance beside the spread: a collective evens the spans out,
    so the rank that does more GPU work shows in its busy time, not in its span."""
    first = summ[summ["judged"] | (summ["range"] == ranks.WHOLE_TRACE)]
    others = summ[~summ.index.isin(first.index)].sort_values(["busy_imbalance", "spread"], ascending=False,
                                                              na_position="last")
    lines = []
    for r in pd.concat([first, others.head(HEADLINE_OTHERS)]).itertuples(index=False):
        slow = f"slowest rank {r.slowest_rank} (spread {r.spread:.3f})" if pd.notna(r.slowest_rank) and \
            pd.notna(r.spread) else "no span"
        busy = (f"busiest rank {int(r.busiest_rank)} (busy imbalance {r.busy_imbalance:.3f}: GPU busy time over the "
                "median)" if pd.notna(r.busiest_rank) and pd.notna(r.busy_imbalance) else "no GPU work on any rank")
        lines.append(f"  {r.range}: {slow}; {busy}; {r.verdicts}")
    if len(others) > HEADLINE_OTHERS:
        lines.append(f"  ... {len(others) - HEADLINE_OTHERS} more ranges without a verdict in cross_rank.csv")
    return lines


def straggler(summ: pd.DataFrame) -> str:
    """The report's first line: the range (whole trace apart) where the busiest rank is furthest above the median."""
    d = summ[(summ["range"] != ranks.WHOLE_TRACE) & summ["busy_imbalance"].notna()]
    if d.empty:
        d = summ[summ["busy_imbalance"].notna()]
    if d.empty:
        return ""
    r = d.sort_values(["busy_imbalance", "range"], ascending=[False, True]).iloc[0]
    if r["busy_imbalance"] < STRAGGLER:
        return f"GPU work is even across the ranks: the largest busy imbalance is {r['busy_imbalance']:.2f}×, in " \
               f"{r['range']}."
    return (f"Straggler: rank {int(r['busiest_rank'])} does {r['busy_imbalance']:.2f}× the median rank's GPU busy "
            f"time in {r['range']}.")


def default_out(name: str) -> pathlib.Path:
    """reports/ranks-<name>, or reports/<name> where the name already says rank (`ranks`, not `ranks-ranks`)."""
    return pathlib.Path("reports") / (name if "rank" in name.lower() else f"ranks-{name}")


def render_html(red: Reduced, title: str, fails: list[str]) -> bytes:
    gpus = {g["name"] for i in red.infos for g in i["meta"].get("gpus", [])}
    ctx = {
        "title": title,
        "generated": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ"),
        "clock_note": CLOCK_NOTE,
        "gpus": sorted(gpus),
        "comm_patterns": list(ranks.COMM_PATTERNS),
        "failures": fails,
        "comm_note": COMM_NOTE.format(patterns=", ".join(ranks.COMM_PATTERNS)) if no_comm_kernels(red.cross)
        else "",
        "straggler": straggler(summary(red.cross)),
        "ranks": report.table(red.ranks, RANK_COLUMNS),
        "summary": report.table(summary(red.cross), SUMMARY_COLUMNS),
        "cross": report.table(red.cross, COLUMNS),
        "headlines": [(i["rank"], i["headline"]) for i in red.infos if i.get("headline")],
        "phases": report.table(red.phases, PHASE_COLUMNS) if red.phases is not None else None,
    }
    return report.environment().get_template("cross_rank.html.j2").render(**ctx).encode()


def csv_by_rank(df: pd.DataFrame, columns: list[str]) -> bytes:
    """The union as CSV, each rank's rows written as the single-trace CSV writes them (a column of whole numbers
    on one rank prints as integers there even when another rank's are fractions)."""
    head = report.csv_bytes(df.head(0), ["rank", *columns])
    parts = [report.csv_bytes(g, ["rank", *columns]).split(b"\n", 1)[1] for _, g in df.groupby("rank", sort=True)]
    return head + b"".join(parts)


def outputs(red: Reduced, title: str, fails: list[str]) -> dict[str, bytes]:
    files = {f"{name}.csv": csv_by_rank(df, analysis.COLUMNS[name])
             for name, df in red.tables.items() if name in analysis.COLUMNS}
    for name, columns in (("steps", None), ("phases", phase_view.PHASE_COLUMNS)):
        df = red.tables.get(name)
        if df is not None and len(df):  # steps.csv: the union's pct_<phase> columns, every rank's phases
            files[f"{name}.csv"] = csv_by_rank(df, columns or [c for c in df.columns if c != "rank"])
    files["ranks.csv"] = report.csv_bytes(red.ranks, RANK_COLUMNS)
    files["cross_rank.csv"] = report.csv_bytes(red.cross, COLUMNS)
    if red.phases is not None:
        files["phases_cross_rank.csv"] = report.csv_bytes(red.phases, PHASE_COLUMNS)
    files["report.html"] = render_html(red, title, fails)
    return files
