"""The RL-step view of one trace (issue 35): which NVTX ranges are phases and steps, steps.csv, phases.csv, the
headline a person reads first, and a typical step's timeline.

Composition only, as pipelines.analysis: the numbers come from ``queries/phase_*.sql`` and ``queries/steps.sql``
over the staged tables (range_instances: each instance's GPU busy time is the interval union of the GPU ops
launched inside it on its thread, the projection's attribution rule); this module decides which ranges are
phases (the ``rlkernel`` domain's ``phase:<name>``, ``--phase`` names, ``--step-range``), joins the per-phase
details into text cells, and words the headline. Log-prob families are data (``rlkernel.op_kernels``).
"""
from __future__ import annotations

import dataclasses
import math

import pandas as pd

from pipelines import sql
from pipelines.durations import fmt_ns
from rlkernel import op_kernels  # torch-free data: the log-prob families' kernel globs

PHASE_PREFIX = "phase:"  # rlkernel.phases: domain rlkernel, `phase:<name>`; `phase:step` is the step
STEP_NAME = "step"
TOP_KERNELS, TOP_SYNCS, TOP_GAPS = 5, 3, 3
TIMELINE_ITEMS = 400
HOST_BOUND_PCT = 50.0  # a phase whose GPU is busy under this share of its wall span is host-bound

STEP_COLUMNS = ["step", "range", "instance", "start_ns", "wall_ns", "gpu_busy_ns", "busy_pct", "gpu_idle_ns",
                "host_syncs", "dtoh_copies", "kernel_ns"]  # then one `pct_<phase>` column per phase
PHASE_COLUMNS = ["phase", "name", "instances", "total_ns", "med_ns", "step_share_pct", "proj_total_ns", "gpu_ops",
                 "gpu_busy_ns", "busy_pct", "gpu_idle_ns", "host_syncs", "syncs_per_step", "sync_calls",
                 "dtoh_copies", "longest_gaps", "top_kernels", "op_verdicts", "logprob_by", "logprob_ns"]


class PhaseError(ValueError):
    """A --phase / --step-range name that matches no range (the message says which, and the closest names)."""


@dataclasses.dataclass
class PhaseView:
    steps: pd.DataFrame
    phases: pd.DataFrame
    headline: str  # "" without steps
    timeline: pd.DataFrame  # timeline.sql's items for the median step
    step_range: str | None


def matches(rng: str, name: str) -> bool:
    """--range's rule: `domain:name`, `:name` for the default domain, or the bare message in any domain."""
    return rng == name or rng.endswith(":" + name)


def check_names(ranges: list[str], phases: list[str], step_range: str | None, messages: list[str] = (),
                where: str = "the input") -> None:
    """PhaseError for the first --phase or --step-range name that matches none of ``ranges``, with the closest."""
    for flag, name in [*(("--phase", p) for p in phases), *((("--step-range", step_range),) if step_range else ())]:
        if not any(matches(r, name) for r in ranges):
            import difflib

            close = difflib.get_close_matches(name, sorted(set(messages) | set(ranges)), n=3, cutoff=0.5)
            hint = f"; closest: {', '.join(close)}" if close else ("; the input has no NVTX ranges" if not ranges
                                                                    else "")
            raise PhaseError(f"{flag} {name}: no such range in {where}{hint}")


def phase_specs(distinct: pd.DataFrame, phases: list[str], step_range: str | None,
                strict: bool = True) -> list[tuple[str, str, bool]]:
    """(range, name, is_step) for every range that is a phase or the step. The rlkernel domain's `phase:<name>`
    ranges are phases by default (`phase:step` the step, unless --step-range names another range); a --phase range
    is named by its message. PhaseError for a --phase or --step-range that matches nothing, unless not ``strict``
    (one rank of several: the name may be another rank's; check_names judges them all together)."""
    ranges = list(distinct[["range", "domain", "message"]].itertuples(index=False, name=None))
    if strict:
        check_names([r for r, _, _ in ranges], phases, step_range, sorted({m for _, _, m in ranges}))
    out = {}
    for rng, domain, message in ranges:
        is_step = bool(step_range) and matches(rng, step_range)
        if domain == "rlkernel" and message.startswith(PHASE_PREFIX):
            name = message[len(PHASE_PREFIX):]
            out[rng] = (rng, name, is_step or (not step_range and name == STEP_NAME))
        elif is_step or any(matches(rng, p) for p in phases):
            out[rng] = (rng, message, is_step)
    # two ranges of one message in different domains stay apart: the second is named by its full range name
    seen: dict[str, str] = {}
    specs = []
    for rng, name, is_step in out.values():
        if name in seen and seen[name] != rng:
            name = rng
        seen[name] = rng
        specs.append((rng, name, is_step))
    return specs


def build(con, distinct: pd.DataFrame, phases: list[str] = (), step_range: str | None = None,
          strict: bool = True) -> PhaseView | None:
    """The view over an analysed connection (dispatch staged), or None when the trace has no phase at all."""
    specs = phase_specs(distinct, list(phases), step_range, strict)
    if not specs:
        return None
    con.execute("CREATE OR REPLACE TEMP TABLE phase_spec (range VARCHAR, name VARCHAR, is_step BOOLEAN)")
    con.executemany("INSERT INTO phase_spec VALUES (?, ?, ?)", [list(s) for s in specs])
    con.execute("CREATE OR REPLACE TEMP TABLE phase_inst AS " + sql.text("phase_instances"))
    con.execute("CREATE OR REPLACE TEMP TABLE phase_ops AS " + sql.text("phase_ops"))
    con.execute("CREATE OR REPLACE TEMP TABLE phase_kernel_ops AS " + sql.text("phase_kernel_ops"))
    con.execute("CREATE OR REPLACE TEMP TABLE logprob_globs (rank INTEGER, family VARCHAR, pat VARCHAR)")
    con.executemany("INSERT INTO logprob_globs VALUES (?, ?, ?)", [list(r) for r in op_kernels.logprob_rows()])
    steps = sql.frame(con, "steps")
    n_steps, steps_ns = len(steps), int(steps["wall_ns"].sum()) if len(steps) else 0
    steps = _with_shares(steps, sql.frame(con, "phase_shares"), con)
    table = sql.frame(con, "phases", {"steps": n_steps, "steps_ns": steps_ns})
    table = _with_details(con, table)
    timeline = sql.frame(con, "step_timeline", {"max_items": TIMELINE_ITEMS}) if n_steps else None
    step = next((r for r, _, s in specs if s), None)
    line = headline(steps, table)
    steps = steps.reindex(columns=[*STEP_COLUMNS, *(c for c in steps.columns if c.startswith("pct_"))])
    return PhaseView(steps, table.reindex(columns=PHASE_COLUMNS), line, timeline, step)


def _with_shares(steps: pd.DataFrame, shares: pd.DataFrame, con) -> pd.DataFrame:
    """steps.csv's `pct_<phase>` columns, one per phase in order of first appearance (empty: not in that step)."""
    ids = con.execute("SELECT range_id FROM phase_inst WHERE is_step ORDER BY start, range_id").fetchall()
    steps = steps.copy()
    steps["_id"] = [i[0] for i in ids]
    names = list(dict.fromkeys(shares.sort_values("first_start")["name"]))
    for name in names:
        s = shares[shares["name"] == name].set_index("step_id")["share_pct"]
        steps[f"pct_{name}"] = steps["_id"].map(s)
    return steps.drop(columns="_id")


def _joined(df: pd.DataFrame, fmt) -> dict[str, str]:
    return {name: "; ".join(fmt(r) for r in g.itertuples(index=False)) for name, g in df.groupby("name", sort=False)}


def _with_details(con, table: pd.DataFrame) -> pd.DataFrame:
    kernels = sql.frame(con, "phase_kernels", {"top": TOP_KERNELS})
    syncs = sql.frame(con, "phase_syncs", {"top": TOP_SYNCS})
    gaps = sql.frame(con, "phase_gaps", {"top": TOP_GAPS})
    verdicts = sql.frame(con, "phase_verdicts")
    logp = sql.frame(con, "phase_logprobs", {"op_ranges": list(op_kernels.LOGPROB_OP_RANGES)})
    t = table.copy()
    t["top_kernels"] = t["name"].map(_joined(kernels, lambda r: f"{r.kernel_short} {int(r.total_ns)} ns"))
    t["sync_calls"] = t["name"].map(_joined(syncs, lambda r: f"{r.api} ({r.rule}) x{int(r.calls)}"))
    t["longest_gaps"] = t["name"].map(_joined(gaps, lambda r: f"{int(r.gap_ns)} ns in #{int(r.instance)}"))
    t["op_verdicts"] = t["name"].map(_joined(verdicts, lambda r: f"{r.range} {r.verdict} x{int(r.calls)}"))
    top = logp.sort_values(["name", "total_ns", "rank"], ascending=[True, False, True]).drop_duplicates("name")
    t["logprob_by"] = t["name"].map(top.set_index("name")["family"])
    t["logprob_ns"] = t["name"].map(top.set_index("name")["total_ns"])
    return t


def _pct(v: float) -> str:
    """A share in percent as a person reads it: one decimal below 10 (never an exponent), whole above, and never
    rounded up to 100 from below."""
    if v < 10:
        return f"{v:.1f}".rstrip("0").rstrip(".")
    return f"{v:.0f}" if v >= 100 or round(v) < 100 else f"{math.floor(v * 10) / 10:.1f}"


def headline(steps: pd.DataFrame, phases: pd.DataFrame) -> str:
    """One sentence: the steps' GPU busy share, the phase taking the most of their wall time and whether it is
    host-bound, and who computed the log-probs at what GPU time per step. "" without steps."""
    if steps.empty:
        return ""
    n = len(steps)
    wall = float(steps["wall_ns"].sum())
    parts = [f"GPU busy {_pct(100.0 * steps['gpu_busy_ns'].sum() / wall if wall else 0.0)} % of the step"
             + (f" ({n} steps)" if n > 1 else "")]
    inner = phases[~phases["is_step"].astype(bool) & phases["step_share_pct"].notna()]
    if len(inner):  # ranked and judged by the unrounded figures (the columns round to 2 decimals)
        top = inner.sort_values(["step_span_ns", "name"], ascending=[False, True]).iloc[0]
        busy = 100.0 * float(top["gpu_busy_ns"]) / float(top["total_ns"]) if top["total_ns"] else 0.0
        bound = "host-bound" if busy < HOST_BOUND_PCT else "GPU-bound"
        parts.append(f"{top['name']} {_pct(float(top['step_share_pct']))} % of wall time, {bound} "
                     f"({float(top['host_syncs']) / n:g} syncs/step)")
    step_rows = phases[phases["is_step"].astype(bool)]
    if len(step_rows) and pd.notna(step_rows.iloc[0]["logprob_by"]):
        s = step_rows.iloc[0]
        parts.append(f"log-probs: {s['logprob_by']}, {fmt_ns(float(s['logprob_ns']) / n)}/step")
    else:
        parts.append("log-probs: no log-prob kernels seen")
    return "; ".join(parts)


