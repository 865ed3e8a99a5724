#!/usr/bin/env bash
# NVIDIA's expert-system rules (`nsys analyze`) on one stripped fixture export, as CSVs beside it: the
# reference for the analyzer's host syncs, GPU idle gaps and GPU utilisation.
#
#   source .node-kit/env.sh && tools/fixture_rules.sh DIR [TRACE]
#
# Reads TRACE (default DIR/trace.sqlite), writes DIR/rules_<rule>.csv (an empty file where the rule found
# nothing) and DIR/rules.log. Arguments make the rules return rows on small fixtures: gpu_gaps reports gaps
# of over GAP_MS whole milliseconds (default 1; nsys's default is 500, and it takes integers only),
# gpu_time_util every chunk under UTIL_PCT percent (default 100: every chunk), every rule up to ROWS rows.
set -uo pipefail
case "${1:-}" in -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac  # help only: nothing run
DIR=${1:?usage: tools/fixture_rules.sh DIR [TRACE]}
TRACE=${2:-$DIR/trace.sqlite}
GAP_MS=${GAP_MS:-1}
UTIL_PCT=${UTIL_PCT:-100}
ROWS=${ROWS:-10000}
mkdir -p "$DIR"
: > "$DIR/rules.log"
for spec in "cuda_api_sync:rows=$ROWS" "cuda_memcpy_sync:rows=$ROWS" "cuda_memcpy_async:rows=$ROWS" \
            "cuda_memset_sync:rows=$ROWS" "gpu_gaps:gap=$GAP_MS:rows=$ROWS" \
            "gpu_time_util:threshold=$UTIL_PCT:rows=$ROWS"; do
  rule=${spec%%:*}
  echo "== nsys analyze --rule $spec" >> "$DIR/rules.log"
  nsys analyze --rule "$spec" --format csv --force-overwrite true --output "$DIR/rules" "$TRACE" \
    >> "$DIR/rules.log" 2>&1 || echo "nsys analyze $rule: exit $?" >> "$DIR/rules.log"
  # nsys names the file after the whole spec (rules_gpu_gaps_gap=1_rows=10000.csv): keep the rule's name only.
  rm -f "$DIR/rules_$rule.csv"
  if [ -e "$DIR/rules_${spec//:/_}.csv" ]; then mv "$DIR/rules_${spec//:/_}.csv" "$DIR/rules_$rule.csv"
  else : > "$DIR/rules_$rule.csv"; fi
done
