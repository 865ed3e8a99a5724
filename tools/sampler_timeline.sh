#!/usr/bin/env bash
# The fused sampler's timeline on a GPU node: probes put into a copy of csrc/ (tools/sampler_timeline/instrument.py),
# a standalone driver built against that copy with nvcc (no torch), run once per configuration given.
#   source .node-kit/env.sh && bash tools/sampler_timeline.sh "256 128256" "1 128256" "256 128256 bf16"
# Prints, per configuration: sample_launch's median time, when the candidates blocks end (and whether a slow block
# is slow because of its SM), the candidates a row, and select's phases. The product is not touched.
# Exit codes: 0 ran, 1 a step failed, 2 usage, 3 nvcc or the GPU missing.
set -u
cd "$(dirname "$0")/.."
case "${1:-}" in -h|--help) sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
[ $# -ge 1 ] || { echo "usage: sampler_timeline.sh \"B V [bf16]\" ..." >&2; exit 2; }
command -v "${NVCC:-nvcc}" >/dev/null || { echo "sampler_timeline: nvcc not found" >&2; exit 3; }
command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 || { echo "sampler_timeline: no GPU" >&2; exit 3; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 tools/sampler_timeline/instrument.py csrc "$work/csrc" || exit 1
echo "sampler_timeline: building the driver"
"${NVCC:-nvcc}" -O3 -std=c++17 -arch=sm_90a -I"$work/csrc" -I"$work/csrc/include" tools/sampler_timeline/driver.cu \
  -o "$work/timeline" || exit 1
rc=0
for cfg in "$@"; do
  echo "=== $cfg"
  # shellcheck disable=SC2086  # the configuration is its words
  "$work/timeline" $cfg || rc=1
done
exit $rc
