#!/usr/bin/env bash
# Is every kernel's machine code the same at two commits? (issue 28: csrc moves of host code only.) No GPU needed.
#   usage: bash tools/compare_sass.sh OLD NEW       (OLD, NEW: commits of this repository)
#   Compiles each csrc/*.cu of both commits with `nvcc -std=c++17 -O3 -Icsrc/include -arch=$ARCH -cubin`, dumps
#   every kernel with `cuobjdump -sass` and `-res-usage`, and compares them kernel by kernel (name, SASS with its
#   encodings, registers/stack/shared memory); a .cu or a kernel found at one commit only counts as a difference.
#   ARCH (default sm_90a), NVCC (default nvcc), CUOBJDUMP (default cuobjdump on the PATH; it needs nvdisasm beside
#   it or on the PATH), JOBS (parallel compiles, default 2), KEEP=DIR (keep the dumps there) choose the rest.
#   The CUDA toolkit of a CPU machine may lack cuobjdump: `pip download --no-deps nvidia-cuda-cuobjdump
#   nvidia-cuda-nvdisasm -d DIR`, unzip both wheels, and put their nvidia/cu13/bin on the PATH (or use the
#   cuobjdump and nvdisasm that the triton wheel ships in triton/backends/nvidia/bin).
# Exit codes: 0 every kernel identical, 1 some kernel differs (each one named), 2 bad usage or a commit whose
# csrc/*.cu does not compile, 3 a tool is missing (nvcc, cuobjdump, git, python3).
set -uo pipefail
case "${1:-}" in -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac  # help only: nothing run
[ $# -eq 2 ] || { echo "compare_sass.sh: needs OLD and NEW commits, got $# argument(s) (see --help)" >&2; exit 2; }
cd "$(dirname "$0")/.."

NVCC=${NVCC:-nvcc}
CUOBJDUMP=${CUOBJDUMP:-cuobjdump}
ARCH=${ARCH:-sm_90a}
JOBS=${JOBS:-2}
for tool in git python3 "$NVCC" "$CUOBJDUMP"; do
  command -v "$tool" >/dev/null || { echo "compare_sass.sh: $tool not found (see --help for cuobjdump)" >&2; exit 3; }
done
case "$JOBS" in ''|*[!0-9]*|0) echo "compare_sass.sh: JOBS must be a positive integer, got '$JOBS'" >&2; exit 2 ;; esac
revs=()
for rev in "$1" "$2"; do
  sha=$(git rev-parse --verify --quiet "$rev^{commit}") || { echo "compare_sass.sh: not a commit: $rev" >&2; exit 2; }
  revs+=("$sha")
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# one tree per side (old/, new/), then one cubin per .cu, compiled JOBS at a time
for side in old new; do
  sha=${revs[0]}; [ $side = new ] && sha=${revs[1]}
  mkdir -p "$work/$side/src" "$work/$side/cubin"
  git archive "$sha" csrc | tar -x -C "$work/$side/src" \
    || { echo "compare_sass.sh: cannot read csrc/ at $sha" >&2; exit 2; }
done
compile() {  # compile SIDE CU: one cubin, its log beside it
  local side=$1 cu=$2
  (cd "$work/$side/src" && "$NVCC" -std=c++17 -O3 -Icsrc/include -arch="$ARCH" -cubin "csrc/$cu" \
     -o "$work/$side/cubin/$cu.cubin") >"$work/$side/cubin/$cu.log" 2>&1
}
pids=() names=()
for side in old new; do
  for path in "$work/$side/src"/csrc/*.cu; do
    [ -e "$path" ] || continue
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
    compile "$side" "$(basename "$path")" & pids+=($!) names+=("$side/$(basename "$path")")
  done
done
bad=0
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then
    side=${names[$i]%%/*} cu=${names[$i]#*/}
    echo "compare_sass.sh: csrc/$cu does not compile at $side commit:" >&2; cat "$work/$side/cubin/$cu.log" >&2; bad=1
  fi
done
[ $bad -eq 0 ] || exit 2
for side in old new; do
  for cubin in "$work/$side/cubin"/*.cubin; do
    [ -e "$cubin" ] || continue
    "$CUOBJDUMP" -sass "$cubin" >"${cubin%.cubin}.sass" 2>"$work/err" \
      && "$CUOBJDUMP" -res-usage "$cubin" >"${cubin%.cubin}.res" 2>>"$work/err" \
      || { echo "compare_sass.sh: $CUOBJDUMP failed on $(basename "$cubin"):" >&2; cat "$work/err" >&2; exit 3; }
  done
done
if [ -n "${KEEP:-}" ]; then  # KEEP/old.logp.sass, KEEP/new.logp.res, ...
  mkdir -p "$KEEP" || exit 2
  for side in old new; do
    for f in "$work/$side/cubin"/*.sass "$work/$side/cubin"/*.res; do cp "$f" "$KEEP/$side.$(basename "$f")"; done
  done
fi

python3 - "$work" "${revs[0]:0:12}" "${revs[1]:0:12}" "$ARCH" <<'EOF'
"""Split each dump into its kernels and compare them by name: the SASS text (instructions and their encodings)
and the resource-usage line."""
import pathlib
import re
import sys

work, old_rev, new_rev, arch = pathlib.Path(sys.argv[1]), *sys.argv[2:]
COMMON = "(the file's common resource usage)"


def kernels(sass: str, res: str) -> dict[str, tuple[str, str]]:
    blocks = re.split(r"^\s*Function : (\S+)\s*$", sass, flags=re.M)  # [head, name1, body1, name2, body2, ...]
    usage = dict(re.findall(r"^\s*Function (\S+):\n\s*(.*)$", res, flags=re.M))
    found = {name: (body, usage.get(name, "")) for name, body in zip(blocks[1::2], blocks[2::2], strict=True)}
    found[COMMON] = ("", res.split(" Function ")[0])  # compared like a kernel, not counted as one
    return found


def side(name: str) -> dict[str, dict]:
    d = work / name / "cubin"
    return {p.stem: kernels(p.read_text(), p.with_suffix(".res").read_text()) for p in sorted(d.glob("*.sass"))}


old, new = side("old"), side("new")
differ = same = 0
for cu in sorted(old.keys() | new.keys()):
    if cu not in old or cu not in new:
        print(f"csrc/{cu}: only at {'new' if cu in new else 'old'} commit"); differ += 1
        continue
    a, b = old[cu], new[cu]
    changed = [k for k in sorted(a.keys() & b.keys()) if a[k] != b[k]]
    only = sorted(a.keys() ^ b.keys())
    for k in changed:
        what = " and ".join(w for w, i in (("SASS", 0), ("resource usage", 1)) if a[k][i] != b[k][i])
        print(f"csrc/{cu}: {k}: {what} differ")
    for k in only:
        print(f"csrc/{cu}: {k}: only at {'new' if k in b else 'old'} commit")
    differ += len(changed) + len(only)
    kept = len((a.keys() & b.keys()) - {COMMON}) - len(set(changed) - {COMMON})
    same += kept
    print(f"csrc/{cu}: {kept} of {len((a.keys() | b.keys()) - {COMMON})} kernels identical")
if differ:
    print(f"compare_sass: DIFFERENT: {differ} kernel(s) or file(s) differ between {old_rev} and {new_rev} ({arch})")
    sys.exit(1)
print(f"compare_sass: identical: {same} kernels in {len(old)} files, {old_rev} vs {new_rev} ({arch})")
EOF
