#!/usr/bin/env bash
# The RL-step view's walkthrough (issue 35) on one GPU: capture GRPO steps of a Qwen2.5-0.5B-shaped TRL run, analyze.
#
#   source .node-kit/env.sh && OUT=/tmp/walk bash tools/rl_step_walkthrough.sh [EXTRA trl_grpo_phases.py ARGS]
#
# `python -m pipelines.capture -- python examples/trl_grpo_phases.py --shape $SHAPE --head $HEAD ...`, then
# `python -m pipelines.analyze` on its export (timed, on 2 cores: taskset -c 0,1), NVIDIA's `nsys stats`
# (nvtx_sum, nvtx_gpu_proj_sum, nvtx_pushpop_trace) and `nsys analyze` (tools/fixture_rules.sh: gpu_gaps,
# gpu_time_util, the four sync rules) on the same export, compared by tools/rl_step_compare.py (the tests' check).
# Settings (environment): SHAPE (qwen2.5-0.5b), HEAD (rlkernel), STEPS (2), COMPLETION (48 tokens: ~120k kernels
# in all), ITERATIONS (1: every step generates), WORK (the whole run; default a temporary folder), PYTHON.
# $OUT (default reports/rl_step_walkthrough) gets 6 files: summary.txt (headline, timings, kernels, comparison),
# walkthrough.log, report.tgz (analyze's folder), nsys.tgz (the NVIDIA CSVs and logs), manifest.json and
# trace.sqlite.xz (the export stripped by tools/traces/strip_export.py, osrt rows emptied: the benchmark input).
set -uo pipefail
case "${1:-}" in -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac  # help only: nothing run
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
SHAPE=${SHAPE:-qwen2.5-0.5b} HEAD=${HEAD:-rlkernel} STEPS=${STEPS:-2} COMPLETION=${COMPLETION:-48}
ITERATIONS=${ITERATIONS:-1}
OUT=${OUT:-$ROOT/reports/rl_step_walkthrough}
WORK=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/rl_step_walkthrough.XXXXXX")}
command -v nsys > /dev/null || { echo "rl_step_walkthrough: nsys not on PATH (source .node-kit/env.sh)" >&2; exit 3; }
OUT=$(mkdir -p "$OUT" && cd "$OUT" && pwd) && mkdir -p "$WORK" || exit 3  # absolute: the steps run from ROOT
LOG=$OUT/walkthrough.log SUMMARY=$OUT/summary.txt
: > "$LOG"
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
cd "$ROOT" || exit 3
export PYTHONUNBUFFERED=1
say "rl_step_walkthrough: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)" \
    "| nsys $(nsys --version | awk '{print $NF}') | tree $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
failed=""

# 1. the capture
cmd=("$PY" examples/trl_grpo_phases.py --shape "$SHAPE" --head "$HEAD" --max-steps "$STEPS"
     --max-completion-length "$COMPLETION" --num-iterations "$ITERATIONS" --device cuda "$@")
say "== capture: python -m pipelines.capture --name rl_step -- ${cmd[*]}"
t0=$(now)
"$PY" -m pipelines.capture --output-dir "$WORK/runs" --name rl_step -- "${cmd[@]}" > "$WORK/capture.stdout" \
  2> >(tee -a "$LOG" >&2)
rc=$?
cat "$WORK/capture.stdout" >> "$LOG"
run=$(tail -n 1 "$WORK/capture.stdout")
grep "^trl_grpo_phases: " "$WORK/capture.stdout" | tee -a "$SUMMARY"
say "capture: exit $rc in $(secs "$t0" "$(now)") s; run $run"
if [ "$rc" != 0 ] || [ ! -f "$run/trace.sqlite" ]; then
  say "rl_step_walkthrough: FAILED: the capture left no export (see walkthrough.log)"
  exit 1
fi
trace=$run/trace.sqlite
say "export: $(du -h "$trace" | cut -f1), $("$PY" -c 'import sqlite3, sys
c = sqlite3.connect(f"file:{sys.argv[1]}?mode=ro", uri=True)
have = {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type = ?", ("table",))}
n = {t: c.execute(f"SELECT count(*) FROM {t}").fetchone()[0] if t in have else 0
     for t in ("CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_RUNTIME", "NVTX_EVENTS")}
print("{} kernels, {} runtime calls, {} NVTX events".format(*n.values()))' "$trace")"

# 2. the analyzer, timed on 2 cores (the target: <= 10 s), its headline
pin=(); command -v taskset > /dev/null && pin=(taskset -c 0,1)
say "== analyze: ${pin[*]} python -m pipelines.analyze RUN --out REPORT"
t0=$(now)
"${pin[@]}" "$PY" -m pipelines.analyze "$run" --out "$WORK/report" > "$WORK/analyze.stdout" 2>> "$LOG"
rc=$?
t1=$(now)
cat "$WORK/analyze.stdout" | tee -a "$LOG"
say "analyze: exit $rc in $(secs "$t0" "$t1") s wall${pin:+ on 2 cores}"
say "headline: $(grep -m1 '^  GPU busy ' "$WORK/analyze.stdout" | sed 's/^  //')"
[ "$rc" = 0 ] || failed="$failed analyze"
tar -czf "$OUT/report.tgz" -C "$WORK" report 2>> "$LOG"

# 3. NVIDIA's numbers for the same export, compared with the analyzer's
mkdir -p "$WORK/nsys"
say "== nsys stats (nvtx_sum, nvtx_gpu_proj_sum, nvtx_pushpop_trace) and nsys analyze (tools/fixture_rules.sh)"
t0=$(now)
nsys stats --report nvtx_sum,nvtx_gpu_proj_sum,nvtx_pushpop_trace --format csv --force-overwrite true \
  --output "$WORK/nsys/stats" "$trace" > "$WORK/nsys/stats.log" 2>&1 || say "nsys stats: exit $? (see nsys.tgz)"
for r in nvtx_sum nvtx_gpu_proj_sum nvtx_pushpop_trace; do
  [ -e "$WORK/nsys/stats_$r.csv" ] || : > "$WORK/nsys/stats_$r.csv"  # no data of that kind: no rows
done
t1=$(now)
bash tools/fixture_rules.sh "$WORK/nsys" "$trace"
say "nsys stats: $(secs "$t0" "$t1") s; nsys analyze (6 rules): $(secs "$t1" "$(now)") s"
tar -czf "$OUT/nsys.tgz" -C "$WORK" nsys 2>> "$LOG"
"$PY" tools/rl_step_compare.py "$WORK/report" "$WORK/nsys" "$trace" 2>&1 | tee -a "$SUMMARY"
[ "${PIPESTATUS[0]}" = 0 ] || failed="$failed compare"

# 4. the stripped, compressed export: the 2-step TRL input of benchmarks/bench_analyze.py's timing
say "== strip + xz"
compress() {  # SRC DST: xz on all cores where it is installed, else Python's lzma (one core, the same format)
  if command -v xz > /dev/null; then xz -T0 -6 -c "$1" > "$2"
  else "$PY" -c 'import lzma, shutil, sys
with open(sys.argv[1], "rb") as src, lzma.open(sys.argv[2], "wb", preset=6) as dst:
    shutil.copyfileobj(src, dst)' "$1" "$2"; fi
}
t0=$(now)
"$PY" tools/traces/strip_export.py "$run/manifest.json" "$OUT/manifest.json" >> "$LOG" 2>&1
"$PY" tools/traces/strip_export.py "$trace" "$WORK/stripped.sqlite" "$ROOT" "$WORK" "$run" >> "$LOG" 2>&1 \
  && "$PY" -c 'import sqlite3, sys
c = sqlite3.connect(sys.argv[1])
for t in ("OSRT_API", "OSRT_CALLCHAINS"):  # no report here nor the analyzer reads them; most of the bytes
    if c.execute("SELECT 1 FROM sqlite_master WHERE type = ? AND name = ?", ("table", t)).fetchone():
        c.execute(f"DELETE FROM {t}")
c.commit()
c.execute("VACUUM")' "$WORK/stripped.sqlite" \
  && compress "$WORK/stripped.sqlite" "$OUT/trace.sqlite.xz.part" \
  && mv "$OUT/trace.sqlite.xz.part" "$OUT/trace.sqlite.xz" \
  || { rm -f "$OUT/trace.sqlite.xz.part"; failed="$failed strip"; }
if [ -f "$OUT/trace.sqlite.xz" ]; then
  say "trace.sqlite.xz: $(du -h "$OUT/trace.sqlite.xz" | cut -f1) (stripped:" \
      "$(du -h "$WORK/stripped.sqlite" | cut -f1)) in $(secs "$t0" "$(now)") s"
  [ "$(stat -c %s "$OUT/trace.sqlite.xz")" -le $((16 * 1024 * 1024)) ] || say "WARNING: trace.sqlite.xz is over 16 MiB"
fi
say "work folder: $WORK"
if [ -n "$failed" ]; then say "rl_step_walkthrough: FAILED:$failed"; exit 1; fi
say "rl_step_walkthrough: done"
