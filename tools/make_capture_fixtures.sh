#!/usr/bin/env bash
# Make the fixtures of `pipelines.capture -- CMD` (issue 34) on a GPU node: captures, each exported, stripped
# (tools/traces/strip_export.py) and written beside NVIDIA's `nsys stats` and `nsys analyze` CSVs for the same file.
#
#   source .node-kit/env.sh && tools/make_capture_fixtures.sh OUTDIR [CASE ...]
#
# CASE (default all): trl (examples/trl_grpo_phases.py, one GRPO step of TRL's GRPOTrainer), torchrun (a 2-process
# gloo torchrun of tools/traces/phases_job.py --steps 3: one export, two ranks), steps (--steps 5:7 of a 20-step
# tools/traces/phases_job.py: only steps 5 to 7 in the trace), liger (tools/traces/liger_job.py --steps 2: Liger's
# log-prob kernels, one phase per family; needs liger-kernel). Output: OUTDIR/capture_<case>/{trace.sqlite,
# manifest.json (both stripped), stats_<report>.csv, stats.log, rules_<rule>.csv, rules.log, recorded.json}, each
# file under 5 MB (else it says which and exits 1); the whole runs stay in OUTDIR/runs/, the command's output in
# OUTDIR/<case>.stdout, capture's in OUTDIR/<case>.log; what the analyzer says of each fixture is printed at the end.
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac  # help only: nothing run
OUTDIR=${1:?usage: tools/make_capture_fixtures.sh OUTDIR [CASE ...]}
for tool in nsys nvidia-smi; do  # exit 3 (blocked), as every command of the project, before OUTDIR is made
  command -v "$tool" > /dev/null || { echo "make_capture_fixtures: $tool not on PATH (source .node-kit/env.sh)" >&2; exit 3; }
done
OUTDIR=$(mkdir -p "$OUTDIR" && cd "$OUTDIR" && pwd)  # absolute: the captures run from the project root
shift
CASES=${*:-trl torchrun steps liger}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python}
REPORTS=cuda_gpu_kern_sum,nvtx_sum,nvtx_kern_sum,nvtx_gpu_proj_sum,cuda_gpu_mem_time_sum,nvtx_pushpop_trace
LIMIT=$((5 * 1024 * 1024))
NSYS_VERSION=$(nsys --version | awk '{print $NF}')
GPU=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
mkdir -p "$OUTDIR/runs"
echo "make_capture_fixtures: nsys $NSYS_VERSION | $GPU | cases: $CASES"

# capture CASE [capture options] -- CMD ...: one run; its directory in $run (the last line on capture's stdout)
capture() {
  local c=$1 rc=0; shift
  echo "== $c: python -m pipelines.capture --name capture_$c $*"
  (cd "$ROOT" && "$PY" -m pipelines.capture --output-dir "$OUTDIR/runs" --name "capture_$c" "$@") \
    > "$OUTDIR/$c.stdout" 2> "$OUTDIR/$c.log" || rc=$?
  run=$(tail -n 1 "$OUTDIR/$c.stdout")
  tail -n 3 "$OUTDIR/$c.log"
  if [ "$rc" != 0 ] || [ ! -f "$run/trace.sqlite" ]; then
    echo "$c: capture exited $rc (see $OUTDIR/$c.log and $OUTDIR/$c.stdout)"
    return 1
  fi
}

# fixture CASE PROGRAM: strip the run's export and manifest into OUTDIR/capture_CASE and write nsys's CSVs beside
fixture() {
  local c=$1 program=$2 dst="$OUTDIR/capture_$1"
  mkdir -p "$dst"
  "$PY" "$ROOT/tools/traces/strip_export.py" "$run/trace.sqlite" "$dst/trace.sqlite" "$ROOT" "$OUTDIR" "$run"
  "$PY" "$ROOT/tools/traces/strip_export.py" "$run/manifest.json" "$dst/manifest.json"
  # osrt's rows (OSRT_API, OSRT_CALLCHAINS: 9 of a TRL step's 10 MB) feed none of the reports below nor the
  # analyzer; emptied before nsys reads the file, so the CSVs are the committed file's own
  "$PY" -c 'import sqlite3, sys
c = sqlite3.connect(sys.argv[1])
for t in ("OSRT_API", "OSRT_CALLCHAINS"):
    if c.execute("select 1 from sqlite_master where type = ? and name = ?", ("table", t)).fetchone():
        c.execute(f"DELETE FROM {t}")
c.commit()
c.execute("VACUUM")' "$dst/trace.sqlite"
  local before after
  before=$(sha256sum "$dst/trace.sqlite" | cut -c1-16)
  nsys stats --report $REPORTS --format csv --force-overwrite true --output "$dst/stats" "$dst/trace.sqlite" \
    > "$dst/stats.log" 2>&1 || echo "nsys stats exit $? (see $dst/stats.log)"
  for r in ${REPORTS//,/ }; do  # a report without data writes no file: an empty one reads as "no rows"
    [ -e "$dst/stats_$r.csv" ] || : > "$dst/stats_$r.csv"
  done
  bash "$ROOT/tools/fixture_rules.sh" "$dst"
  after=$(sha256sum "$dst/trace.sqlite" | cut -c1-16)
  [ "$before" = "$after" ] || echo "WARNING: nsys stats/analyze modified capture_$c/trace.sqlite"
  "$PY" - "$dst/recorded.json" "capture_$c" "$program" "$NSYS_VERSION" "$GPU" "$dst/manifest.json" "$REPORTS" <<'PY'
import datetime, json, sys
path, case, program, nsys, gpu, manifest, reports = sys.argv[1:]
m = json.load(open(manifest))
json.dump({"case": case, "program": program, "nsys_version": nsys, "gpu": gpu,
           "nsys_flags": " ".join(m["steps"][0]["command"]), "stats_reports": reports,
           "phases": m["target"]["phases"], "step_indices": m["target"]["step_indices"],
           "recorded_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")},
          open(path, "w"), indent=1)
PY
  local big
  big=$(find "$dst" -type f -size +"$LIMIT"c)
  if [ -n "$big" ]; then echo "capture_$c: over 5 MB: $big"; return 1; fi
  ls -la "$dst"
}

failed=""
for c in $CASES; do
  case "$c" in
    trl)
      { capture trl -- "$PY" examples/trl_grpo_phases.py --max-steps 1 --device cuda &&
        fixture trl "examples/trl_grpo_phases.py --max-steps 1 --device cuda"; } || failed="$failed $c" ;;
    torchrun)
      { capture torchrun -- "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
          tools/traces/phases_job.py --steps 3 &&
        fixture torchrun "torchrun --standalone --nproc-per-node 2 tools/traces/phases_job.py --steps 3"; } \
        || failed="$failed $c" ;;
    steps)
      { capture steps --steps 5:7 -- "$PY" tools/traces/phases_job.py --steps 20 &&
        fixture steps "pipelines.capture --steps 5:7 -- tools/traces/phases_job.py --steps 20"; } \
        || failed="$failed $c" ;;
    liger)
      { capture liger -- "$PY" tools/traces/liger_job.py --steps 2 &&
        fixture liger "tools/traces/liger_job.py --steps 2"; } || failed="$failed $c" ;;
    *) echo "unknown case $c (known: trl torchrun steps liger)"; exit 2 ;;
  esac
done

echo "== what the analyzer says of each fixture"
for c in $CASES; do
  dst="$OUTDIR/capture_$c"
  echo "-- capture_$c: phases and steps in its manifest"
  "$PY" -c 'import json, sys; t = json.load(open(sys.argv[1]))["target"]; print(t["phases"]); print("steps", t["step_indices"])' \
    "$dst/manifest.json"
  (cd "$ROOT" && "$PY" -m pipelines.analyze "$dst" --out "$OUTDIR/report-$c") || echo "analyze capture_$c: exit $?"
  if [ "$c" = torchrun ]; then
    (cd "$ROOT" && "$PY" -m pipelines.analyze --ranks "$dst" --out "$OUTDIR/report-$c-ranks") \
      || echo "analyze --ranks capture_torchrun: exit $?"
  fi
done
if [ -n "$failed" ]; then echo "make_capture_fixtures: FAILED:$failed"; exit 1; fi
