#!/usr/bin/env bash
# Make the analyzer's test fixtures on a GPU node: run each tools/traces/<case>.py under nsys,
# export SQLite, strip it (tools/traces/strip_export.py), and write beside it the CSVs that
# `nsys stats` prints for that same stripped file -- the reference the tests compare against.
#
#   source .node-kit/env.sh && tools/make_fixtures.sh OUTDIR [CASE ...]
#
# CASE defaults to every fixture case; `many` (the 1M-launch scale trace, not a fixture) runs
# only when named, with MANY_N launches (default 1000000); MANY_STATS=0 skips its pinned `nsys stats`.
# Output: OUTDIR/<case>/{trace.sqlite, stats_<report>.csv, stats.log, rules_<rule>.csv, rules.log,
# recorded.json}: the rules are NVIDIA's expert system on the same stripped file (tools/fixture_rules.sh).
# CASE `ranks` is one job of RANKS_WORLD (3) processes on the one GPU, each under its own nsys:
# OUTDIR/ranks/{trace_rank<N>.sqlite, stats_rank<N>_<report>.csv, stats.log, recorded.json}.
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac  # help only: nothing run
OUTDIR=${1:?usage: tools/make_fixtures.sh OUTDIR [CASE ...]}
for tool in nsys nvidia-smi; do  # exit 3 (blocked), as every command of the project, before any work
  command -v "$tool" > /dev/null || { echo "make_fixtures: $tool not on PATH (source .node-kit/env.sh)" >&2; exit 3; }
done
shift
CASES=${*:-nvtx_mix verdicts graphs multiproc no_nvtx no_cuda verl_ranges sync_loop ranks}
REPORTS=cuda_gpu_kern_sum,nvtx_sum,nvtx_kern_sum,nvtx_gpu_proj_sum,cuda_gpu_mem_time_sum
WORK=$(mktemp -d)
NSYS_VERSION=$(nsys --version | awk '{print $NF}')
GPU=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)
echo "make_fixtures: nsys $NSYS_VERSION | $GPU | work dir $WORK"

# recorded.json: what made the fixture (program, nsys, GPU, flags, time)
record() {
  python - "$OUTDIR/$1/recorded.json" "$1" "$NSYS_VERSION" "$GPU" "$2" <<'PY'
import datetime, json, sys
path, case, nsys, gpu, flags = sys.argv[1:]
json.dump({"case": case, "program": f"tools/traces/{case}.py", "nsys_version": nsys, "gpu": gpu,
           "nsys_flags": flags, "stats_reports": "cuda_gpu_kern_sum,nvtx_sum,nvtx_kern_sum,nvtx_gpu_proj_sum,cuda_gpu_mem_time_sum",
           "recorded_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")},
          open(path, "w"), indent=1)
PY
}

# ranks: RANKS_WORLD processes (default 3) of tools/traces/ranks.py, each under its own nsys, as one gloo job on
# the one GPU: OUTDIR/ranks/trace_rank<N>.sqlite and stats_rank<N>_<report>.csv (no rules: nsys analyze per rank
# adds nothing the single-trace fixtures do not cover).
ranks_case() {
  local flags=(--trace=cuda,nvtx --sample=none --cpuctxsw=none --force-overwrite=true)
  local world=${RANKS_WORLD:-3} port=$((29500 + RANDOM % 1000)) pids=() r
  mkdir -p "$OUTDIR/ranks"
  for ((r = 0; r < world; r++)); do
    RANK=$r WORLD_SIZE=$world MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      nsys profile "${flags[@]}" -o "$WORK/rank$r" python tools/traces/ranks.py > "$WORK/rank$r.log" 2>&1 &
    pids+=($!)
  done
  for r in "${!pids[@]}"; do
    wait "${pids[$r]}" || { echo "ranks: rank $r failed:"; tail -20 "$WORK/rank$r.log"; return 1; }
  done
  for ((r = 0; r < world; r++)); do
    nsys export --type sqlite --force-overwrite true --output "$WORK/rank$r.sqlite" "$WORK/rank$r.nsys-rep"
    python tools/traces/strip_export.py "$WORK/rank$r.sqlite" "$OUTDIR/ranks/trace_rank$r.sqlite" "$WORK"
    nsys stats --report $REPORTS --format csv --force-overwrite true --output "$OUTDIR/ranks/stats_rank$r" \
      "$OUTDIR/ranks/trace_rank$r.sqlite" >> "$OUTDIR/ranks/stats.log" 2>&1 || echo "nsys stats rank $r: exit $?"
  done
  record ranks "${flags[*]} x $world ranks"
  ls -la "$OUTDIR/ranks"
}

for c in $CASES; do
  if [ "$c" = ranks ]; then ranks_case; continue; fi
  t0=$SECONDS
  flags=(--trace=cuda,nvtx --sample=none --cpuctxsw=none --force-overwrite=true)
  args=()
  [ "$c" = graphs ] && flags+=(--cuda-graph-trace=node)
  mkdir -p "$OUTDIR/$c"
  [ "$c" = verdicts ] && args+=("$OUTDIR/$c/manifest.json")
  [ "$c" = many ] && args+=("${MANY_N:-1000000}")
  echo "== $c: profile"
  nsys profile "${flags[@]}" -o "$WORK/$c" python tools/traces/$c.py "${args[@]}"
  echo "== $c: export ($((SECONDS - t0)) s)"
  nsys export --type sqlite --force-overwrite true --output "$WORK/$c.sqlite" "$WORK/$c.nsys-rep"
  if [ "$c" = many ]; then
    # The scale trace is measured, not committed: stats pinned to 2 cores, like the analyzer
    # (MANY_STATS=0 skips them: the benchmark of the analyzer alone).
    [ "${MANY_STATS:-1}" = 1 ] && python tools/traces/measure.py "nsys-stats-pinned many" taskset -c 0,1 \
      nsys stats --report $REPORTS --format csv --force-overwrite true --output "$OUTDIR/$c/stats" "$WORK/$c.sqlite" \
      > "$OUTDIR/$c/stats.log" 2>&1 || echo "nsys stats skipped or failed (see stats.log)"
    tail -3 "$OUTDIR/$c/stats.log" 2>/dev/null || true
    ls -la "$WORK/$c.sqlite"
    mv "$WORK/$c.sqlite" "$OUTDIR/$c/trace.sqlite"
    continue
  fi
  python tools/traces/strip_export.py "$WORK/$c.sqlite" "$OUTDIR/$c/trace.sqlite" "$WORK"
  sum_before=$(sha256sum "$OUTDIR/$c/trace.sqlite" | cut -c1-16)
  echo "== $c: stats ($((SECONDS - t0)) s)"
  nsys stats --report $REPORTS --format csv --force-overwrite true --output "$OUTDIR/$c/stats" \
    "$OUTDIR/$c/trace.sqlite" > "$OUTDIR/$c/stats.log" 2>&1 || echo "nsys stats exit $? (see stats.log)"
  bash "$(dirname "$0")/fixture_rules.sh" "$OUTDIR/$c"
  sum_after=$(sha256sum "$OUTDIR/$c/trace.sqlite" | cut -c1-16)
  [ "$sum_before" = "$sum_after" ] || echo "WARNING: nsys stats/analyze modified $c/trace.sqlite"
  record "$c" "${flags[*]}"
  ls -la "$OUTDIR/$c"
  echo "== $c: done in $((SECONDS - t0)) s"
done
rm -rf "$WORK"
