#!/usr/bin/env bash
# The plain install's fused path on a GPU node (issue 30), measured: no in-tree build anywhere.
#
#   bash tools/gpu_install_check.sh [STAGE ...]     (PYTHON: the interpreter; MAX_JOBS: parallel compiles)
#
# Each stage makes the sdist of this tree (any rlkernel/_C*.so left out) and installs it with --no-deps
# --no-build-isolation into an empty --target (RLKERNEL_BUILD_EXT=0), then runs from outside the tree with that
# folder first on PYTHONPATH and an empty RLKERNEL_CACHE_DIR of its own. Stages (default: first concurrent):
#   first       rlkernel.logp(..., require_fused=True) builds and runs (the build time), then a second process
#               loads the cache (the load time after `import torch`) and runs fused again
#   concurrent  4 processes started at once: one builds, three wait and load it (the wall time)
# Prints the figures, and writes them to $OUT/gpu_install_check.txt when OUT is set.
# Exit codes: 0 every check passed, 1 one failed, 2 bad usage, 3 this machine cannot build (no CUDA GPU, nvcc, ninja).
set -u
case "${1:-}" in -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac  # help only: nothing run
stages=${*:-first concurrent}
for s in $stages; do
  case "$s" in first|concurrent) ;; *) echo "gpu_install_check: unknown stage $s (first, concurrent; see --help)" >&2
    exit 2 ;; esac
done
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
say() { echo "gpu_install_check: $*"; [ -z "${OUT:-}" ] || echo "$*" >> "$OUT/gpu_install_check.txt"; }
[ -z "${OUT:-}" ] || { mkdir -p "$OUT" && : > "$OUT/gpu_install_check.txt"; }
# PYTHONPATH without the tree (a node kit puts its packages and the tree there): the install must be what imports
kit=$(printf '%s' "${PYTHONPATH:-}" | tr ':' '\n' | grep -v -x -F -e "$root" -e "$root/" -e "" | paste -sd: -)

# what the machine needs, in the tree's own words (rlkernel._jit's checks)
why=$(PYTHONPATH="$root${kit:+:$kit}" "$py" -c '
import torch
from rlkernel import _ext, _jit
if not torch.cuda.is_available():
    raise SystemExit("no CUDA GPU visible")
try:
    spec = _ext.rlkernel_spec()
except _ext.ExtensionNotBuilt as exc:
    raise SystemExit(exc.detail)
print(_jit.missing_tool(spec) or "", end="")' 2>&1) || { say "blocked: $why"; exit 3; }
[ -z "$why" ] || { say "blocked: $why"; exit 3; }

install() {  # install DIR: the sdist of this tree into DIR/site; prints nothing on success
  local dir=$1
  mkdir -p "$dir/src" "$dir/dist"
  (cd "$root" && find rlkernel pipelines queries reports_templates csrc setup.py pyproject.toml README.md \
      -path '*/__pycache__' -prune -o -type f ! -name '*.so' -print | tar cf - -T -) | tar xf - -C "$dir/src"
  (cd "$dir/src" && "$py" -c "from setuptools import build_meta as b; b.build_sdist('$dir/dist')") \
    > "$dir/sdist.log" 2>&1 || { cat "$dir/sdist.log"; return 1; }
  RLKERNEL_BUILD_EXT=0 "$py" -m pip install -q --no-deps --no-build-isolation --no-index --target "$dir/site" \
    "$dir"/dist/rlkernel-*.tar.gz > "$dir/pip.log" 2>&1 || { cat "$dir/pip.log"; return 1; }
  if find "$dir/site" -name '_C*.so' | grep -q .; then echo "the install holds an rlkernel._C build"; return 1; fi
}

# one process that wants the fused path: prints a JSON line of its figures (stderr: rlkernel's own lines)
PROBE='
import json, os, sys, time
t0 = time.perf_counter()
import torch
torch.cuda.init()
t1 = time.perf_counter()
import rlkernel
from rlkernel import _ext
assert rlkernel.__file__.startswith(os.environ["SITE"]), rlkernel.__file__
state = _ext.ensure()  # what the first fused call does: load the cache, or build it
t2 = time.perf_counter()
logits = torch.randn(64, 32000, device="cuda", dtype=torch.bfloat16)
ids = torch.randint(0, 32000, (64,), device="cuda")
lp = rlkernel.logp(logits, ids, require_fused=True)
ref = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, None]).squeeze(-1)
err = (lp - ref).abs().max().item()
st = rlkernel.fused_status()
print(json.dumps({"load_s": t2 - t1, "built_s": st["build_seconds"], "source": st["source"], "archs": st["archs"],
                  "max_abs_err": err, "dispatch": sorted({r["status"] for r in rlkernel.dispatch.history_json()})}))
'
run_probe() {  # run_probe DIR NAME: one process with DIR's install and cache
  (cd "$1" && SITE="$1/site" PYTHONPATH="$1/site${kit:+:$kit}" RLKERNEL_CACHE_DIR="$1/cache" "$py" -c "$PROBE" \
    > "$1/$2.out" 2> "$1/$2.err")
}
field() {  # field FILE KEY: one figure of a probe's JSON line (a list joined with commas)
  "$py" -c "import json,sys; v=json.loads(open(sys.argv[1]).read().splitlines()[-1])[sys.argv[2]]; \
print(','.join(v) if isinstance(v, list) else v)" "$@"
}
fused_ok() {  # fused_ok FILE: the process ran the fused path and its log-probs agree with torch's
  "$py" -c "import json,sys; d=json.loads(open(sys.argv[1]).read().splitlines()[-1]); \
sys.exit(0 if d['dispatch'] == ['fused'] and d['max_abs_err'] < 5e-2 else 1)" "$1" 2>/dev/null
}
show_failure() { cat "$1.err"; log=$(ls "$(dirname "$1")"/cache/*.log 2>/dev/null | head -1); [ -z "$log" ] || tail -n 30 "$log"; }

fail=0
stage_first() {
  local dir=$work/first t0
  install "$dir" || { say "first: FAIL installing the sdist"; fail=1; return; }
  say "first: the sdist installed into an empty --target ($(cd "$dir/site" && ls -d rlkernel/csrc) holds the sources)"
  t0=$SECONDS
  if ! run_probe "$dir" one || ! fused_ok "$dir/one.out"; then
    say "first: FAIL (the first fused call)"; show_failure "$dir/one"; fail=1; return
  fi
  say "first: build + first fused call $((SECONDS - t0)) s (build $(field "$dir/one.out" built_s) s for" \
      "$(field "$dir/one.out" archs), MAX_JOBS=${MAX_JOBS:-unset (ninja picks)}); rlkernel said:"
  grep '^rlkernel: ' "$dir/one.err" | sed 's/^/    /'
  if ! run_probe "$dir" two || ! fused_ok "$dir/two.out" || [ "$(field "$dir/two.out" built_s)" != None ] \
      || grep -q '^rlkernel: building' "$dir/two.err"; then
    say "first: FAIL (the second process did not load the cache and run fused)"; show_failure "$dir/two"; fail=1
    return
  fi
  say "first: second process: loaded from the $(field "$dir/two.out" source) in" \
      "$(printf '%.3f' "$(field "$dir/two.out" load_s)") s after import torch (bound: 0.5 s), fused"
  "$py" -c "import sys; sys.exit(0 if float(sys.argv[1]) <= 0.5 else 1)" "$(field "$dir/two.out" load_s)" \
    || { say "first: FAIL the cached load is over 0.5 s"; fail=1; }
}

stage_concurrent() {
  local dir=$work/concurrent t0 i pids=() builds waits ok=0
  install "$dir" || { say "concurrent: FAIL installing the sdist"; fail=1; return; }
  t0=$SECONDS
  for i in 1 2 3 4; do run_probe "$dir" "rank$i" & pids+=($!); done
  for i in 0 1 2 3; do wait "${pids[$i]}" && fused_ok "$dir/rank$((i + 1)).out" && ok=$((ok + 1)); done
  builds=$(cat "$dir"/rank*.err | grep -c '^rlkernel: building')
  waits=$(cat "$dir"/rank*.err | grep -c '^rlkernel: waiting')
  say "concurrent: 4 processes at once: $builds build(s), $waits waited, $ok of 4 ran fused, $((SECONDS - t0)) s wall"
  if [ "$builds" -ne 1 ] || [ "$ok" -ne 4 ]; then
    say "concurrent: FAIL (want 1 build and 4 fused runs)"; for i in 1 2 3 4; do show_failure "$dir/rank$i"; done
    fail=1
  fi
}

for s in $stages; do "stage_$s"; done
[ $fail -eq 0 ] && say "all checks passed" || say "a check FAILED"
exit $fail
