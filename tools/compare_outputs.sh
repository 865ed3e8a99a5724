#!/usr/bin/env bash
# The analyzer's outputs at two commits, compared byte for byte: the proof that a refactor changed no output.
#
#   tools/compare_outputs.sh OLD_COMMIT NEW_COMMIT        e.g. tools/compare_outputs.sh 4cbc7e6 HEAD
#
# Each commit is unpacked (git archive: committed files only, the working tree is not read) into a temporary
# folder and runs `python -m pipelines.analyze` from there (PYTHONPATH) on the same inputs, the NEW commit's
# tests/data: every run directory (a folder holding trace.sqlite) as one INPUT with --require-fused
# --require-no-sync, and again with --ranks; every other .sqlite as a single export; every folder of per-rank
# exports with --ranks; the bundled example with no INPUT (its default report folder); and a fixed set of
# --compare, --range, several-INPUT and bad-usage runs. Both commits run in the same folder, one after the other,
# so every path they see and print is the same. Compared: every file written (CSV and JSON byte for byte;
# report.html with its "Report generated <time>" filtered), each run's exit code, its stdout (the "(1.9 s)"
# timings filtered) and its "pipelines.analyze: " stderr lines (verdicts and errors; the progress lines vary).
#
# Exit codes: 0 identical, 1 a difference (the files named, the first lines of each diff shown), 2 bad usage
# (not two commits of this repository), 3 the analyzer cannot run here (PYTHON, default python3, lacks its
# packages, or the NEW commit fails on its own bundled example). The temporary folder is removed on exit.
set -uo pipefail
case "${1:-}" in -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac  # help only: nothing run

me=compare_outputs.sh
die() { echo "$me: $2" >&2; exit "$1"; }
[ $# -eq 2 ] || die 2 "give OLD_COMMIT NEW_COMMIT (see --help)"
repo=$(git -C "$(dirname "$0")" rev-parse --show-toplevel 2>/dev/null) || die 2 "$(dirname "$0"): not in a git checkout"
old=$(git -C "$repo" rev-parse --verify --quiet "$1^{commit}") || die 2 "$1: not a commit of $repo"
new=$(git -C "$repo" rev-parse --verify --quiet "$2^{commit}") || die 2 "$2: not a commit of $repo"
PY=${PYTHON:-python3}
"$PY" -c "import duckdb, pandas, jinja2" 2>/dev/null || die 3 "$PY cannot import duckdb, pandas and jinja2"

work=$(mktemp -d "${TMPDIR:-/tmp}/compare-outputs.XXXXXX") || die 3 "cannot make a temporary folder"
trap 'rm -rf "$work"' EXIT
trap 'exit 130' INT TERM  # the EXIT trap still cleans up

for side in old new; do
  mkdir -p "$work/src-$side"
  git -C "$repo" archive "${!side}" | tar -x -C "$work/src-$side" || die 3 "git archive ${!side} failed"
done
data="$work/src-new/tests/data"
[ -d "$data" ] || die 2 "$2 has no tests/data"

# The runs, one per line: NAME ARGS... (no spaces inside a name or an argument; paths relative to the run folder).
cases="$work/cases"
{
  echo "example-default"  # no INPUT: the bundled example, written to reports/example
  echo "example-checks --require-fused --require-no-sync --out out/example-checks"
  (cd "$data" && find . -name trace.sqlite | sort) | while read -r t; do
    d=${t#./}; d=${d%/trace.sqlite}; n=${d//\//_}
    echo "dir-$n data/$d --require-fused --require-no-sync --out out/dir-$n"
    echo "ranks-$n --ranks data/$d --require-fused --out out/ranks-$n"
  done
  (cd "$data" && find . -name '*.sqlite' ! -name trace.sqlite | sort) | while read -r f; do
    f=${f#./}; n=${f//\//_}
    echo "file-$n data/$f --require-fused --require-no-sync --out out/file-$n"
  done
  (cd "$data" && find . -name '*.sqlite' ! -name trace.sqlite -printf '%h\n' | sort -u) | while read -r d; do
    d=${d#./}; n=${d//\//_}
    echo "rankdir-$n --ranks data/$d --require-fused --out out/rankdir-$n"
  done
  want() { for p in "$@"; do [ -e "$data/$p" ] || return 1; done; }
  want verdicts && echo "compare-same data/verdicts --compare data/verdicts --out out/compare-same"
  want verdicts example_with_sync &&
    echo "compare-forced data/example_with_sync --compare data/verdicts --force --out out/compare-forced"
  want sync_loop/trace.sqlite &&
    echo "range data/sync_loop/trace.sqlite --range rl:op.fwd --require-no-sync --out out/range"
  want verdicts && echo "range-missing data/verdicts --range logp-nativ --out out/range-missing"
  want verdicts no_nvtx && echo "several data/verdicts data/no_nvtx --out out/several"
  want verdicts no_nvtx && echo "several-range-missing data/verdicts data/no_nvtx --range nosuch --out out/srm"
  want ranks verdicts && echo "ranks-with-input --ranks data/ranks data/verdicts --out out/ranks-with-input"
  want ranks && echo "ranks-range --ranks data/ranks --range ranks:step --require-fused --out out/ranks-range"
  want ranks && echo "ranks-range-missing --ranks data/ranks --range nosuch --out out/ranks-range-missing"
  want ranks && echo "ranks-out-cwd --ranks data/ranks --out ."
  want ranks && echo "ranks-jobs-0 --ranks data/ranks --jobs 0"
  want ranks && echo "ranks-executor --ranks data/ranks --executor bogus --out out/ranks-executor"
  echo "jobs-without-ranks --jobs 2"
  echo "missing-input data/no-such.sqlite --out out/missing-input"
  want verdicts && echo "out-cwd data/verdicts --out ."
} > "$cases"

run_side() {  # run every case with one commit's analyzer, in $work/run, then move the results to $work/$1
  local side=$1 name args rc
  rm -rf "$work/run" && mkdir -p "$work/run/log" && cp -R "$data" "$work/run/data"
  while read -r name args; do
    # shellcheck disable=SC2086  # ARGS split on spaces on purpose
    (cd "$work/run" && PYTHONPATH="$work/src-$side" PYTHONDONTWRITEBYTECODE=1 "$PY" -m pipelines.analyze $args \
       > "log/$name.stdout" 2> "log/$name.stderr.all" < /dev/null)
    rc=$?
    echo "exit $rc" > "$work/run/log/$name.rc"
    sed -E -i 's/\(([0-9]+\.)?[0-9]+ s\)/(<t> s)/' "$work/run/log/$name.stdout"
    grep '^pipelines\.analyze: ' "$work/run/log/$name.stderr.all" | grep -v ': waiting for another run' \
      > "$work/run/log/$name.stderr"
    rm "$work/run/log/$name.stderr.all"
  done < "$cases"
  find "$work/run" -name report.html -exec sed -E -i \
    's/Report generated [0-9]{4}-[0-9]{2}-[0-9]{2} [0-9]{2}:[0-9]{2}:[0-9]{2}Z/Report generated <time>/' {} +
  mv "$work/run" "$work/$side"
}

echo "$me: $(wc -l < "$cases") analyzer runs per commit; old ${old:0:12}, new ${new:0:12}"
run_side new
[ "$(cat "$work/new/log/example-default.rc")" = "exit 0" ] ||
  die 3 "the analyzer at $2 fails on its bundled example: $(head -1 "$work/new/log/example-default.stderr")"
run_side old
# what the runs did (a table of exit codes), so that "identical" cannot hide runs that all failed the same way
echo "$me: exit codes at $2: $(cat "$work"/new/log/*.rc | sort | uniq -c |
  awk '{printf "%s%d runs exit %s", (NR > 1 ? ", " : ""), $1, $3}')"

if diff -r -q "$work/old" "$work/new" > "$work/differ"; then
  echo "$me: identical: $(find "$work/new" -type f ! -path "*/data/*" ! -path "*/log/*" | wc -l) output files and" \
       "$(wc -l < "$cases") runs' exit codes, stdout and error lines (report.html without its generated time)"
  exit 0
fi
echo "$me: outputs differ between $1 and $2:"
sed "s|$work/||g" "$work/differ"
diff -r -u "$work/old" "$work/new" | sed "s|$work/||g" | head -80
exit 1
