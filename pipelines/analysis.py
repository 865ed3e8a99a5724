"""One trace's analysis: stage it, ask the questions in ``queries/``, return their tables.

Composition only: the numbers come from the SQL files (``pipelines.sql``); this module decides which ranges
are workloads, which kernel names prove the fused path, and which ops ran native on purpose, from the
registry (``rlkernel.workloads``, imported lazily and optional: a bare trace analyzes without torch), the
run's manifest, and the command line.
"""
from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import sys
import threading
import time

import pandas as pd

from pipelines import ncu_csv, phase_view, sql, trace_db
from rlkernel import op_kernels, textsafe  # torch-free: each op's helper kernel globs; names made printable

DEFAULT_PATTERNS = ("rlkernel_*",)

# The exact columns of each output CSV (issue 8; GPU time apart from the span: issue 18). docs/trace-schema.md,
# "Output columns", says what each one is.
GPU_TIME = ["kernel_ns", "gpu_busy_ns", "gpu_idle_ns", "host_syncs", "dtoh_copies"]
COLUMNS = {
    "kernel_summary": ["kernel", "kernel_short", "instances", "total_ns", "avg_ns", "med_ns", "min_ns", "max_ns",
                       "stddev_ns", "time_pct"],
    "range_summary": ["range", "style", "instances", "range_total_ns", "proj_total_ns", "gpu_ops", *GPU_TIME],
    "range_kernels": ["range", "style", "kernel", "kernel_short", "kernel_instances", "total_ns", "avg_ns",
                      "med_ns", "min_ns", "max_ns", "stddev_ns"],
    "dispatch": ["level", "range", "instance", "start_ns", "verdict", "fused_kernels", "other_kernels",
                 "helper_kernels", "proj_gpu_ns", *GPU_TIME],
    "gaps": ["pid", "device_id", "start_ns", "end_ns", "gap_ns"],
    "utilization": ["pid", "device_id", "start_ns", "dur_ns", "in_use_pct", "busy_pct"],
    "repetition_gaps": ["workload", "instance", "gap_rank", "gap_start_ns", "gap_ns", "host_calls", "host_syncs",
                        "outside_calls_ns", "longest_calls"],
    "bandwidth": ["workload", "instances", "bytes", "mean_proj_gpu_ns", "mean_gpu_busy_ns", "gb_per_s",
                  "peak_gb_per_s", "pct_of_peak", "ncu_launches", "ncu_dram_bytes", "ncu_gpu_time_ns", "ncu_gb_per_s",
                  "ncu_dram_pct_of_peak"],
}


@dataclasses.dataclass
class Source:
    """What to analyze: an export, and the run directory (with its manifest) it came from, if any."""

    trace: pathlib.Path
    run_dir: pathlib.Path | None = None
    manifest: dict | None = None
    ncu_csv: pathlib.Path | None = None
    provenance: dict | None = None  # the bundled example's where/when record


@dataclasses.dataclass
class Result:
    source: Source
    meta: dict
    tables: dict[str, pd.DataFrame]
    workloads: pd.DataFrame
    patterns: list[str]
    counts: dict[str, int]
    seconds: float
    held_syncs: pd.DataFrame | None = None  # queries/held_syncs.sql: syncs inside instances that must not block
    timeline: pd.DataFrame | None = None  # queries/timeline.sql: one steady-state repetition per workload
    first_calls: pd.DataFrame | None = None  # queries/first_calls.sql: each op range's first call apart
    phase_view: phase_view.PhaseView | None = None  # steps.csv, phases.csv, the headline (pipelines.phase_view)


def progress(msg: str) -> None:
    """One progress line on stderr, escaped as analyze.say() escapes (a file or range name holding ESC or a
    newline would recolour the terminal or forge a line: textsafe.terminal)."""
    print(textsafe.terminal(f"analyze: {msg}"), file=sys.stderr, flush=True)


HEARTBEAT_S = 10.0  # the longest silence while a big trace stages (issue 18)
GAP_MS = 1  # gaps.csv: GPU idle gaps longer than this (nsys gpu_gaps' `gap` option; its default is 500)
UTIL_CHUNKS = 30  # utilization.csv: gpu_time_util's default chunk count; every chunk kept (threshold: none)
REPETITION_GAPS = 3  # repetition_gaps.csv: the longest gaps of each workload repetition
TIMELINE_ITEMS = 400  # the report's timeline: at most this many items of each kind per workload (longest first)


class Heartbeat:
    """The current step and its fraction done, printed when it starts and again every ``every`` seconds while it
    runs: DuckDB releases the GIL while a statement runs, so a daemon thread can speak meanwhile."""

    def __init__(self, label: str, every: float = HEARTBEAT_S):
        self.label, self.every, self.t0 = label, every, time.perf_counter()
        self.phase, self.step, self.at, self._stop = "staging", "", (0, 0), threading.Event()
        self._lock = threading.Lock()
        self._last, self._said = self.t0, False

    def _say(self, still: bool) -> None:
        with self._lock:
            self._last, self._said = time.perf_counter(), True
            # the step now running, k of n: a "0 % done" for the first step read as if nothing had been done
            progress(f"{self.label}: {'still ' if still else ''}{self.phase} {self.step} (step {self.at[0]} of "
                     f"{self.at[1]}, {self._last - self.t0:.1f} s)")

    def __call__(self, step: str, done: int, total: int, phase: str | None = None) -> None:
        """A new step: said at once unless something was said in the last fifth of a heartbeat (small traces
        stay quiet); the heartbeat says it later if it runs long."""
        self.phase = phase or self.phase
        self.step, self.at = step, (done + 1, max(total, 1))
        if not self._said or time.perf_counter() - self._last >= self.every / 5:
            self._say(False)

    def _run(self) -> None:
        poll = self.every / 20  # speak a poll early, so that no silence outlasts `every`
        while not self._stop.wait(poll):
            if self.step and time.perf_counter() - self._last >= self.every - poll:
                self._say(True)

    @contextlib.contextmanager
    def running(self):
        t = threading.Thread(target=self._run, daemon=True)
        t.start()
        try:
            yield self
        finally:
            self._stop.set()
            t.join()


def registry() -> dict[str, dict]:
    """name -> {fused_ops, fused_patterns, path}: the torch-free catalog of the registry
    (rlkernel.workload_catalog), or the live registry where rlkernel.workloads is imported already (a caller in
    the same process may have registered workloads of its own); never an import of torch for it."""
    workloads = sys.modules.get("rlkernel.workloads")
    if workloads is None:
        from rlkernel.workload_catalog import CATALOG

        return {name: {k: (list(v) if isinstance(v, list) else v) for k, v in entry.items() if k != "op"}
                for name, entry in CATALOG.items()}
    out = {}
    for name in workloads.names():
        w = workloads.get(name)
        out[name] = {"fused_ops": list(w.fused_ops), "fused_patterns": list(w.fused_patterns), "path": w.path}
    return out


def known_workloads(manifest: dict | None, range_messages: set[str]) -> dict[str, dict]:
    """The registry's workloads, overridden by the manifest's (the run's own record wins)."""
    known: dict[str, dict] = {}
    if any(m for m in range_messages):
        known.update(registry())
    for w in (manifest or {}).get("workloads", []):
        known[w["name"]] = {"fused_ops": list(w.get("fused_ops", [])),
                            "fused_patterns": list(w.get("fused_patterns", [])), "path": w.get("path", "")}
    return known


def workload_specs(ranges: pd.DataFrame, known: dict[str, dict], extra: list[str]) -> list[tuple]:
    """(range, name, fused_ops, expects_fused) for every range judged as a workload.

    Registry/manifest workload names in domain rlkernel; names given with --range (as `domain:name` or the bare
    message); and, for traces of other programs, any range whose message ends in `-fused`.
    """
    specs = []
    for rng, domain, message in ranges[["range", "domain", "message"]].itertuples(index=False):
        if domain == "rlkernel" and message.startswith("op."):
            continue
        info = known.get(message)
        if (domain == "rlkernel" and info) or rng in extra or message in extra or message.endswith("-fused"):
            fused_ops = list((info or {}).get("fused_ops", []))
            expects = bool(fused_ops) or (info or {}).get("path") == "fused" or message.endswith("-fused")
            specs.append((rng, message, fused_ops, expects))
    return specs


def native_ops(manifest: dict | None) -> list[str]:
    """Ops the dispatch records show running native on purpose, and never falling back."""
    recs = (manifest or {}).get("dispatch", [])
    native = {r["op"] for r in recs if r.get("status") == "native"}
    bad = {r["op"] for r in recs if r.get("status") in ("fallback", "blocked")}
    return sorted(native - bad)


def fused_patterns(manifest: dict | None, known: dict[str, dict], present: set[str], cli: list[str]) -> list[str]:
    """The globs whose kernels prove a fused path: rlkernel's own (``rlkernel_*``: every fused kernel of ours is so
    named, docs/contracts.md section 3), the registry's for the workloads present, the manifest's and ``cli``'s,
    all added together (a user's ``--fused-pattern 'liger*'`` must not turn rlkernel's fused ops into fallbacks)."""
    pats: list[str] = list(DEFAULT_PATTERNS)
    for name in sorted(present):
        pats += known.get(name, {}).get("fused_patterns", [])
    for w in (manifest or {}).get("workloads", []):
        pats += w.get("fused_patterns", [])
    pats += cli
    return sorted(set(pats))


def helper_globs() -> list[tuple[str, str]]:
    """(op, glob): the kernels other than the fused patterns' that an op's fused range may run (its cuBLAS GEMMs),
    declared once in rlkernel/op_kernels.py (docs/contracts.md, section 3)."""
    return op_kernels.helper_rows()


def load_ncu(con, path: pathlib.Path | None) -> None:
    con.execute("CREATE OR REPLACE TEMP TABLE ncu_metrics (range VARCHAR, instance BIGINT, kernel VARCHAR, "
                "launch BIGINT, metric VARCHAR, unit VARCHAR, value DOUBLE)")
    if path is None or not path.exists():
        return
    try:
        rows = ncu_csv.read_long(path)  # checked: integers within int64, exact text
    except ncu_csv.NcuCsvError as e:
        raise trace_db.TraceError(str(e)) from None
    df = pd.DataFrame(rows, columns=list(ncu_csv.LONG_COLUMNS), dtype=object)
    for col, kind in (("instance", "Int64"), ("launch", "Int64"), ("value", "Float64")):
        df[col] = df[col].astype(kind)  # nullable: an empty instance, an n/a value stay NULL
    con.register("ncu_df", df)
    con.execute("INSERT INTO ncu_metrics SELECT * FROM ncu_df")
    con.unregister("ncu_df")


def analyze(src: Source, *, patterns: list[str] = (), ranges: list[str] = (), con=None, prepare=None,
            phases: list[str] | None = None, step_range: str | None = None, strict_phases: bool = True) -> Result:
    """``prepare(con)``, when given, runs on the loaded ``src_*`` tables before staging (pipelines.ranks keeps
    one process of a multi-process export there). ``phases`` (a list, maybe empty: the rlkernel domain's
    ``phase:<name>`` ranges are phases anyway) and ``step_range`` ask for the RL-step view (steps.csv,
    phases.csv, the headline: pipelines.phase_view); None leaves it out. ``strict_phases`` False: a --phase or
    --step-range name this trace lacks is no error (one rank of several: pipelines.ranks)."""
    with Heartbeat(src.trace.name).running() as beat:
        return _analyze(src, patterns, ranges, con, beat, prepare, phases, step_range, strict_phases)


def _analyze(src: Source, patterns, ranges, con, beat: Heartbeat, prepare=None, phases=None,
             step_range=None, strict_phases=True) -> Result:
    t0 = time.perf_counter()
    beat.phase, beat.step = "loading", "the export"  # said only if it outlasts a heartbeat: bad input stays one line
    trace = trace_db.open_trace(src.trace, con)
    c = trace.con
    if prepare is not None:
        prepare(c)
    progress(f"{src.trace.name}: loaded in {time.perf_counter() - t0:.1f} s; staging")
    sql.stage(c, lambda step, done, total: beat(step, done, total, "staging"))
    counts = dict(zip(("kernels", "memory_ops", "ranges"), c.execute(
        "SELECT count(*) FILTER (WHERE kind = 'kernel'), count(*) FILTER (WHERE kind <> 'kernel'), "
        "(SELECT count(*) FROM ranges) FROM gpu_ops").fetchone(), strict=True))
    progress(f"{src.trace.name}: {counts['kernels']} kernels, {counts['memory_ops']} copies/sets, "
             f"{counts['ranges']} ranges, staged at {time.perf_counter() - t0:.1f} s")

    distinct = c.execute("SELECT DISTINCT range, domain, message FROM ranges ORDER BY range").df()
    rl_messages = set(distinct.loc[distinct["domain"] == "rlkernel", "message"])
    known = known_workloads(src.manifest, rl_messages)
    specs = workload_specs(distinct, known, list(ranges))
    c.execute("CREATE OR REPLACE TEMP TABLE workload_spec (range VARCHAR, name VARCHAR, fused_ops VARCHAR[], "
              "expects_fused BOOLEAN)")
    if specs:
        c.executemany("INSERT INTO workload_spec VALUES (?, ?, ?, ?)", [list(s) for s in specs])
    pats = fused_patterns(src.manifest, known, {s[1] for s in specs}, list(patterns))
    c.execute("CREATE OR REPLACE TEMP TABLE op_helper_globs (op VARCHAR, pat VARCHAR)")
    c.executemany("INSERT INTO op_helper_globs VALUES (?, ?)", [list(r) for r in helper_globs()])

    questions = ("kernel_summary", "range_summary", "range_kernels", "verdicts", "workload_summary")
    tables = {}
    for i, name in enumerate(questions[:3]):
        beat(name, i, len(questions), "questions")
        tables[name] = sql.frame(c, name)
    beat("verdicts", 3, len(questions), "questions")
    c.execute("CREATE OR REPLACE TEMP TABLE dispatch AS " + sql.text("verdicts"),
              {"patterns": pats, "native_ops": native_ops(src.manifest)})
    dispatch = c.execute("SELECT * FROM dispatch").df()
    tables["dispatch"] = dispatch
    c.execute("CREATE OR REPLACE TEMP TABLE workload_summary AS " + sql.text("workload_summary"))
    workloads = c.execute("SELECT * FROM workload_summary").df()

    mw = [(w["name"], int(w.get("bytes") or 0), int(w.get("flops") or 0))
          for w in (src.manifest or {}).get("workloads", [])]
    c.execute("CREATE OR REPLACE TEMP TABLE manifest_workloads (name VARCHAR, bytes BIGINT, flops BIGINT)")
    if mw:
        c.executemany("INSERT INTO manifest_workloads VALUES (?, ?, ?)", mw)
        load_ncu(c, src.ncu_csv)
        tables["bandwidth"] = sql.frame(c, "bandwidth")
    held = sql.frame(c, "held_syncs", {"ranges": list(ranges)})
    tables["gaps"] = sql.frame(c, "gpu_gaps", {"gap_ns": GAP_MS * 1_000_000})
    tables["utilization"] = sql.frame(c, "gpu_time_util", {"chunks": UTIL_CHUNKS, "threshold": float("inf")})
    tables["repetition_gaps"] = sql.frame(c, "repetition_gaps", {"top": REPETITION_GAPS})
    timeline = sql.frame(c, "timeline", {"max_items": TIMELINE_ITEMS})
    first_calls = sql.frame(c, "first_calls")
    view = None
    if phases is not None or step_range:
        beat("phases", len(questions), len(questions), "questions")
        view = phase_view.build(c, distinct, list(phases or ()), step_range, strict_phases)
        if view is not None:
            tables["steps"], tables["phases"] = view.steps, view.phases
    seconds = time.perf_counter() - t0
    progress(f"{src.trace.name}: analyzed in {seconds:.1f} s")
    return Result(src, trace.meta(), tables, workloads, pats, counts, seconds, held, timeline, first_calls, view)


def sync_failures(result: Result) -> list[str]:
    """--require-no-sync: each host sync inside a fused op range, a fused single-op workload's repetition or a
    --range instance, naming the instance and the call (queries/held_syncs.sql says which instances)."""
    h = result.held_syncs
    if h is None:
        return []
    return [f"{r.level} {r.range} #{int(r.instance)}: {r.api} ({r.rule}) at {int(r.call_start)} ns, "
            f"blocking {int(r.call_ns)} ns" for r in h.itertuples(index=False)]


def failures(result: Result) -> list[str]:
    """--require-fused: workloads that must be fused and are not, and their required op ranges that are not."""
    d = result.tables["dispatch"]
    bad = []
    for r in d.itertuples(index=False):
        if r.required_fused and r.verdict != "fused":
            where = f" in {r.in_workload} #{int(r.in_workload_instance)}" if r.level == "op" else ""
            bad.append(f"{r.level} {r.range} #{int(r.instance)}{where}: {r.verdict}")
    return bad
