#!/usr/bin/env bash
# CI compile gate (tox -e csrc; docs/contracts.md section 8). No GPU needed.
#   usage: bash tools/compile_gate.sh            (no arguments; NVCC, CXX, PYTHON choose the tools)
#   1. every csrc/*.cu (kernels + launchers, no torch include) with nvcc for sm_80 and sm_90a, and the sampler's
#      timeline driver (tools/sampler_timeline/) against its probed copy of csrc/;
#   2. every csrc/*.cpp but cuda_stream.cpp and python_module.cpp (library.cpp and the op files: registration only)
#      with the headers of the installed torch wheel (the CPU one in CI);
#   3. csrc/python_module.cpp (the Python module) with those and Python's headers (skipped where Python.h is missing);
#   4. csrc/cuda_stream.cpp only where the installed torch has CUDA (the CPU wheel lacks c10/cuda headers).
# Without nvcc it prints "skipped: nvcc not found" and exits 0, unless CI or RLKERNEL_REQUIRE_NVCC is true.
# Exit codes: 0 all compiled (or skipped), 1 a file failed to compile, 2 a bad CI/RLKERNEL_REQUIRE_NVCC value,
# 3 a tool is missing (nvcc under CI/RLKERNEL_REQUIRE_NVCC, g++, torch).
set -uo pipefail
case "${1:-}" in -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac  # help only: nothing run
[ $# -eq 0 ] || { echo "compile_gate.sh: takes no arguments, got: $* (see --help)" >&2; exit 2; }
cd "$(dirname "$0")/.."

NVCC=${NVCC:-nvcc}
CXX=${CXX:-g++}
PY=${PYTHON:-python}
if ! command -v "$NVCC" >/dev/null; then
  # A machine without the CUDA toolkit (the README's test command on a laptop) skips the gate; CI, which has nvcc,
  # or RLKERNEL_REQUIRE_NVCC makes its absence a failure. Booleans as rlkernel.envflags reads them (a bad value:
  # its one line, exit 2).
  ci=$("$PY" -m rlkernel.envflags CI) && required=$("$PY" -m rlkernel.envflags RLKERNEL_REQUIRE_NVCC) || exit 2
  if [ "$ci" = true ] || [ "$required" = true ]; then
    echo "compile gate: nvcc not found (install the CUDA toolkit, or set NVCC)" >&2; exit 3
  fi
  echo "compile gate: skipped: nvcc not found (CI=true or RLKERNEL_REQUIRE_NVCC=1 make this a failure)"; exit 0
fi
command -v "$CXX" >/dev/null || { echo "compile gate: $CXX not found (install g++, or set CXX)" >&2; exit 3; }
TORCH_INC=$("$PY" -c "import torch.utils.cpp_extension as c; print(' '.join('-I' + p for p in c.include_paths()))") \
  || { echo "compile gate: torch not importable by $PY (pip install torch)" >&2; exit 3; }
TORCH_CUDA=$("$PY" -c "import torch; print(torch.version.cuda or '')")

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
fail=0
step() {  # step NAME CMD...: run a compile, report it, remember a failure
  local name=$1; shift
  local t0=$SECONDS
  if "$@" >"$out/log" 2>&1; then
    echo "compile gate: ok   $name ($((SECONDS - t0)) s)"
  else
    echo "compile gate: FAIL $name"; cat "$out/log"; fail=1
  fi
}

# the epilogue GEMM's CUTLASS / CuTe headers (the pinned nvidia-cutlass wheel; without it that file compiles as a
# stub that refuses, as the extension's build does)
CUTLASS_INC=$("$PY" rlkernel/cutlass_headers.py) || { echo "compile gate: rlkernel/cutlass_headers.py failed" >&2; exit 3; }
CUTLASS_FLAGS=()
if [ -n "$CUTLASS_INC" ]; then CUTLASS_FLAGS=(-I"$CUTLASS_INC"); else echo "compile gate: no nvidia-cutlass headers: the epilogue GEMM compiles as its stub"; fi

shopt -s nullglob
cu_files=(csrc/*.cu)
[ ${#cu_files[@]} -gt 0 ] || { echo "compile gate: no csrc/*.cu found" >&2; exit 1; }
for cu in "${cu_files[@]}"; do
  # --expt-relaxed-constexpr: CuTe needs it, and torch's extension build passes it to every .cu
  step "$cu [sm_80, sm_90a]" "$NVCC" -std=c++17 -O3 -Icsrc/include "${CUTLASS_FLAGS[@]}" --expt-relaxed-constexpr \
    -Xptxas=-warn-spills \
    -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a \
    -c "$cu" -o "$out/$(basename "$cu").o"
done
# the sampler's timeline tool (tools/sampler_timeline.sh): its probed copy of csrc/ and the driver built against it
if "$PY" tools/sampler_timeline/instrument.py csrc "$out/probed" > "$out/log" 2>&1; then
  step "tools/sampler_timeline/driver.cu [sm_90a, probed csrc]" "$NVCC" -std=c++17 -O3 -I"$out/probed" \
    -I"$out/probed/include" -arch=sm_90a -c tools/sampler_timeline/driver.cu -o "$out/timeline.o"
else
  echo "compile gate: FAIL tools/sampler_timeline/instrument.py"; cat "$out/log"; fail=1
fi
for cpp in csrc/*.cpp; do  # registration files (library.cpp and the ops' own): torch/library.h level only
  case "$cpp" in csrc/cuda_stream.cpp|csrc/python_module.cpp) continue ;; esac
  # shellcheck disable=SC2086  # TORCH_INC is a list of -I flags
  step "$cpp [torch headers]" "$CXX" -std=c++20 -O0 -Wall -fPIC $TORCH_INC -Icsrc/include \
    -c "$cpp" -o "$out/$(basename "$cpp").o"
done
PY_INC=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
if [ -e "$PY_INC/Python.h" ]; then
  # shellcheck disable=SC2086
  step "csrc/python_module.cpp [torch + Python headers]" "$CXX" -std=c++20 -O0 -Wall -fPIC $TORCH_INC -I"$PY_INC" \
    -Icsrc/include -DTORCH_EXTENSION_NAME=_C -c csrc/python_module.cpp -o "$out/python_module.o"
else
  echo "compile gate: skip csrc/python_module.cpp (no Python.h under $PY_INC)"
fi
if [ -n "$TORCH_CUDA" ]; then
  CUDA_INC=$(dirname "$(dirname "$(command -v "$NVCC")")")/include
  # shellcheck disable=SC2086
  step "csrc/cuda_stream.cpp [torch CUDA $TORCH_CUDA headers]" "$CXX" -std=c++20 -O0 -Wall -fPIC $TORCH_INC \
    -I"$PY_INC" -I"$CUDA_INC" -Icsrc/include -c csrc/cuda_stream.cpp -o "$out/cuda_stream.o"
else
  echo "compile gate: skip csrc/cuda_stream.cpp (torch $("$PY" -c 'import torch; print(torch.__version__)') has no CUDA headers)"
fi
[ $fail -eq 0 ] && echo "compile gate: passed" || echo "compile gate: FAILED"
exit $fail
