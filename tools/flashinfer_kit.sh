#!/usr/bin/env bash
# Builds .fi/, FlashInfer's top-k/top-p sampler cut to what fits beside .node-kit/ on the offline GPU node, for the
# flashinfer column of benchmarks/bench_sampling.py. Here it needs PyPI (pip); the node then fetches nothing.
#   usage: bash tools/flashinfer_kit.sh [--version V] [--arch A] [--no-build] [--work DIR]
#     --version V  flashinfer-python version (default 0.7.4); --arch A: FLASHINFER_CUDA_ARCH_LIST (default 9.0a)
#     --no-build   no nvcc here: the node compiles the two modules on first use (its nvcc, minutes)
#     --work DIR   keep the downloads and the build in DIR, reused by a later run (default: a temp folder)
#   1. downloads flashinfer-python, apache-tvm-ffi (for python 3.12, the node's, and for $PYTHON), nvidia-ml-py,
#      ninja and nvidia-curand's headers;
#   2. site/: the modules `import flashinfer.sampling` reads (flashinfer's and flashinfer.jit's __init__ cut to the
#      version and the JIT core), tvm_ffi, pynvml; bin/ninja; curand/ (headers);
#   3. builds flashinfer's sampling and topk JIT modules with nvcc for A (about 15 min on 2 cores) into
#      site/flashinfer/data/aot/, which flashinfer loads without compiling, and keeps the sources and headers the
#      build read (a rebuild on the node); checks `import flashinfer.sampling` with $PYTHON;
#   4. writes .fi/kit.tar.xz (2 and 3) and .fi/env.sh, and prints the kit's size. On the node, from the repo root:
#      `source .fi/env.sh` (unpacks the kit into .fi/ once; PYTHONPATH, flashinfer's cache and JIT variables).
# PYTHON (default python3, with pip and torch) runs the downloads, the build and the check; NVCC or CUDA_HOME: nvcc.
# Exit codes: 0 built, 1 a step failed (download, build, import check), 2 bad arguments, 3 a tool is missing.
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac  # help only: nothing run

version=0.7.4 arch=9.0a build=1 work=
while [ $# -gt 0 ]; do
  case $1 in
    --version|--arch|--work) [ $# -ge 2 ] || { echo "flashinfer_kit.sh: $1 needs a value (see --help)" >&2; exit 2; }
      case $1 in --version) version=$2 ;; --arch) arch=$2 ;; --work) work=$2 ;; esac; shift 2 ;;
    --no-build) build=0; shift ;;
    *) echo "flashinfer_kit.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
root=$PWD
PY=${PYTHON:-python3}
"$PY" -c "import torch, pip" 2>/dev/null \
  || { echo "flashinfer_kit.sh: $PY lacks torch or pip (set PYTHON)" >&2; exit 3; }
if [ "$build" = 1 ]; then
  nvcc=${NVCC:-$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")}
  [ -x "$nvcc" ] || { echo "flashinfer_kit.sh: nvcc not found (set NVCC or CUDA_HOME, or --no-build)" >&2; exit 3; }
  cuda_home=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$nvcc")")")}
  [ -f "$cuda_home/include/cuda_runtime.h" ] || cuda_home=/usr/local/cuda  # nvcc may be a wrapper script
  [ -f "$cuda_home/include/cuda_runtime.h" ] \
    || { echo "flashinfer_kit.sh: no CUDA toolkit beside $nvcc (set CUDA_HOME)" >&2; exit 3; }
  command -v "${CXX:-c++}" >/dev/null || { echo "flashinfer_kit.sh: ${CXX:-c++} not found (set CXX)" >&2; exit 3; }
fi
if [ -z "$work" ]; then work=$(mktemp -d); trap 'rm -rf "$work"' EXIT; fi
mkdir -p "$work" && work=$(cd "$work" && pwd)
fail() { echo "flashinfer_kit.sh: $*" >&2; exit 1; }

# 1. downloads
pip_dl() { "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$work/dl" "$@" || fail "pip download $* failed"; }
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64)
pip_dl "flashinfer-python==$version" nvidia-ml-py
pip_dl --python-version 3.12 --implementation cp "${plat[@]}" "apache-tvm-ffi<0.2,>=0.1.11" ninja
pip_dl "apache-tvm-ffi<0.2,>=0.1.11"  # $PYTHON's build, for the check and the build here
pip_dl "${plat[@]}" --python-version 3.12 "nvidia-curand>=10.4,<10.5"  # curand.h for CUDA 13 (headers only used)

# 2. the kit, assembled in $work/kit, then moved to .fi
export WORK=$work VERSION=$version
"$PY" - <<'EOF' || fail "assembling the kit failed"
import ast, glob, os, pathlib, shutil, sys, zipfile
work = pathlib.Path(os.environ["WORK"]); dl = work / "dl"
kit, src = work / "kit", work / "src"
shutil.rmtree(kit, ignore_errors=True)
def one(pattern):
    hits = sorted(glob.glob(str(dl / pattern)))
    if not hits: sys.exit(f"no {pattern} in {dl}")
    return hits[-1]
# the full flashinfer tree (its data/ too: the build reads headers from it), less the big kernel folders of csrc/
mark = src / f".extracted-{os.environ['VERSION']}"  # kept by --work: same files, same times, no rebuild
if not mark.exists():
    shutil.rmtree(src, ignore_errors=True)
    with zipfile.ZipFile(one(f"flashinfer_python-{os.environ['VERSION']}-*.whl")) as z:
        z.extractall(src, [n for n in z.namelist() if n.startswith("flashinfer/")
                           and not (n.startswith("flashinfer/data/csrc/") and n.count("/") > 3)])
    mark.touch()
for f, text in (("__init__.py",
    '"""FlashInfer, cut by tools/flashinfer_kit.sh to flashinfer.sampling (the full __init__ imports every kernel '
    'family)."""\nfrom .version import __git_commit__ as __git_commit__\n'
    'from .version import __version__ as __version__\n'),
                ("jit/__init__.py",
    '"""flashinfer.jit, cut by tools/flashinfer_kit.sh to the JIT core (the full one imports every generator)."""\n'
    "import ctypes\nimport os\n\nfrom . import env as env\nfrom .core import JitSpec as JitSpec\n"
    "from .core import build_jit_specs as build_jit_specs\nfrom .core import gen_jit_spec as gen_jit_spec\n\n"
    'cuda_lib_path = os.environ.get("CUDA_LIB_PATH", "/usr/local/cuda/targets/x86_64-linux/lib/")\n'
    'if os.path.exists(f"{cuda_lib_path}/libcudart.so.12"):\n'
    '    ctypes.CDLL(f"{cuda_lib_path}/libcudart.so.12", mode=ctypes.RTLD_GLOBAL)\n')):
    if (src / "flashinfer" / f).read_text() != text:  # unchanged file, unchanged time
        (src / "flashinfer" / f).write_text(text)
# the modules flashinfer.sampling imports, at any depth (function-level imports too)
def modfile(mod):
    p = src / mod.replace(".", "/")
    for f in (p / "__init__.py", p.with_suffix(".py")):
        if f.exists():
            return f
seen, todo = set(), ["flashinfer.sampling"]
while todo:
    m = todo.pop()
    f = modfile(m)
    if f is None or m in seen:
        continue
    seen.add(m)
    pkg = m.split(".") if f.name == "__init__.py" else m.split(".")[:-1]
    todo += [".".join(m.split(".")[:i]) for i in range(1, m.count(".") + 1)]
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.ImportFrom):
            name = ".".join(pkg[:len(pkg) - node.level + 1] + [node.module] if node.module else
                            pkg[:len(pkg) - node.level + 1]) if node.level else (node.module or "")
            todo += [name] + [f"{name}.{a.name}" for a in node.names] if name.startswith("flashinfer") else []
        elif isinstance(node, ast.Import):
            todo += [a.name for a in node.names if a.name.startswith("flashinfer")]
for m in seen:
    rel = modfile(m).relative_to(src)
    (kit / "site" / rel).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src / rel, kit / "site" / rel)
print(f"flashinfer_kit: {len(seen)} flashinfer modules")
# tvm_ffi for 3.12, plus this python's extension module (same version) so the kit imports here too; no C++
# sources, libbacktrace or stub generator (its core links libtvm_ffi_testing.so: that stays)
with zipfile.ZipFile(one("apache_tvm_ffi-*-cp312-*.whl")) as z:
    z.extractall(kit / "site", [n for n in z.namelist() if n.startswith("tvm_ffi/") or ".dist-info/" in n])
here = one(f"apache_tvm_ffi-*-cp{sys.version_info[0]}{sys.version_info[1]}-*.whl")
with zipfile.ZipFile(here) as z:
    if not (work / "site/tvm_ffi").exists():  # for the build here; kept by --work (new times: a rebuild)
        z.extractall(work / "site")
    z.extractall(kit / "site", [n for n in z.namelist() if n.startswith("tvm_ffi/core.")])
tv = kit / "site/tvm_ffi"
for p in ("3rdparty/libbacktrace", "src", "stub", "cython", "testing"):
    shutil.rmtree(tv / p, ignore_errors=True) if (tv / p).is_dir() else (tv / p).unlink(missing_ok=True)
with zipfile.ZipFile(one("nvidia_ml_py-*.whl")) as z:
    z.extract("pynvml.py", kit / "site"); z.extract("pynvml.py", work / "site")
with zipfile.ZipFile(one("ninja-*.whl")) as z:
    n = next(n for n in z.namelist() if n.endswith("/scripts/ninja"))
    for d in (kit / "bin", work / "bin"):
        d.mkdir(parents=True, exist_ok=True)
        (d / "ninja").write_bytes(z.read(n)); (d / "ninja").chmod(0o755)
with zipfile.ZipFile(one("nvidia_curand-*.whl")) as z:
    if not (work / "curand").exists():
        z.extractall(work / "curand", [n for n in z.namelist() if n.startswith("nvidia/cu13/include/")])
(kit / "curand").mkdir()
EOF

# 3. the two modules, built by flashinfer's own JIT (its flags, its ninja file) for $arch, then put where flashinfer
# looks for prebuilt (AOT) modules; a stand-in libcuda.so for the link (the driver's is not here; the modules call
# the runtime API only). The sources and headers the build read go beside them, for a rebuild on the node.
jit_env=(FLASHINFER_CUDA_ARCH_LIST="$arch" FLASHINFER_WORKSPACE_BASE="$work/ws" TVM_FFI_DISABLE_TORCH_C_DLPACK=1
         PYTHONPATH="$work/src:$work/site" PATH="$work/bin:$PATH" MAX_JOBS="$(nproc)" FLASHINFER_NVCC_THREADS=2)
if [ "$build" = 1 ]; then
  mkdir -p "$work/stub" && printf '' >"$work/stub/empty.c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$work/stub/libcuda.so" "$work/stub/empty.c" || fail "libcuda stand-in"
  env "${jit_env[@]}" CUDA_HOME="$cuda_home" FLASHINFER_NVCC="$nvcc" FLASHINFER_EXTRA_LDFLAGS="-L$work/stub" \
    FLASHINFER_EXTRA_CUDAFLAGS="-isystem $work/curand/nvidia/cu13/include" "$PY" - <<'EOF' || fail "nvcc build failed"
import os, pathlib, shutil, subprocess, time
from flashinfer.jit.sampling import gen_sampling_module
from flashinfer.jit.topk import gen_topk_module
work = pathlib.Path(os.environ["FLASHINFER_WORKSPACE_BASE"]).parent
src, kit = work / "src/flashinfer", work / "kit"
read = set()
for spec in (gen_sampling_module(), gen_topk_module()):
    t0 = time.time()
    spec.build(verbose=False)
    aot = kit / "site/flashinfer/data/aot" / spec.name / f"{spec.name}.so"
    aot.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["strip", "--strip-unneeded", "-o", aot, spec.jit_library_path], check=True)
    print(f"flashinfer_kit: built {spec.name} ({aot.stat().st_size / 2**20:.1f} MiB, {time.time() - t0:.0f} s)")
    deps = subprocess.run([work / "bin/ninja", "-C", spec.build_dir, "-t", "deps"], capture_output=True, text=True,
                          check=True).stdout
    read |= {pathlib.Path(l.strip()) for l in deps.splitlines() if l.startswith(" ")}
for p in read:
    to = (kit / "site/flashinfer" / p.relative_to(src) if p.is_relative_to(src) else
          kit / "curand" / p.name if p.is_relative_to(work / "curand") else None)  # the rest: CUDA's, tvm_ffi's
    if to:
        to.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(p, to)
print(f"flashinfer_kit: {len(read)} sources and headers read by the build")
EOF
else
  (cd "$work/src" && cp -r --parents flashinfer/data/csrc/*.cu flashinfer/data/csrc/*.h flashinfer/data/include \
    flashinfer/data/cccl "$work/kit/site/" && cp "$work"/curand/nvidia/cu13/include/* "$work/kit/curand/") \
    || fail "copying the sources"
fi

# 4. env.sh, the check, the move
cat >"$work/env.sh" <<'EOF'
# Source on the GPU node from the repo root: `source .fi/env.sh` (made by tools/flashinfer_kit.sh). Unpacks
# .fi/kit.tar.xz once and puts its flashinfer first on PYTHONPATH. The sampling and topk modules are prebuilt
# (site/flashinfer/data/aot/); one that will not load is rebuilt by flashinfer with nvcc and ninja (.fi/bin's when
# none is on PATH) from the sources and headers beside it, into $FLASHINFER_WORKSPACE_BASE.
_fi=$PWD/.fi
[ -d "$_fi/site" ] || { rm -rf "$_fi/.new" && mkdir "$_fi/.new" && tar -xJf "$_fi/kit.tar.xz" -C "$_fi/.new" \
  && mv "$_fi/.new"/* "$_fi/" && rmdir "$_fi/.new"; } || echo "env.sh: unpacking .fi/kit.tar.xz failed" >&2
export PYTHONPATH="$_fi/site${PYTHONPATH:+:$PYTHONPATH}" PATH="$PATH:$_fi/bin"
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-${TMPDIR:-/tmp}/flashinfer-ws}
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-ARCH} FLASHINFER_EXTRA_CUDAFLAGS="-isystem $_fi/curand"
export TVM_FFI_CACHE_DIR=${TVM_FFI_CACHE_DIR:-${TMPDIR:-/tmp}/tvm-ffi}
echo "env.sh: flashinfer $(python3 -c 'import flashinfer; print(flashinfer.__version__)' 2>&1 | tail -1) from $_fi/site"
EOF
sed -i "s/:-ARCH}/:-$arch}/" "$work/env.sh"
check="import flashinfer, flashinfer.sampling as s; assert callable(s.top_k_top_p_sampling_from_logits)
print('flashinfer_kit: import ok, flashinfer', flashinfer.__version__)"
(cd "$work/kit/site" && PYTHONPATH=. TVM_FFI_DISABLE_TORCH_C_DLPACK=1 "$PY" -c "$check") \
  || fail "import flashinfer.sampling from the kit failed"
find "$work/kit" -name __pycache__ -prune -exec rm -rf {} +
tar -cf - -C "$work/kit" site bin curand | xz -T0 -6 >"$work/kit.tar.xz" || fail "packing kit.tar.xz failed"
rm -rf .fi && mkdir .fi && cp "$work/kit.tar.xz" "$work/env.sh" .fi/
exclude=$(git rev-parse --git-path info/exclude 2>/dev/null) && ! grep -qx '/.fi/' "$exclude" 2>/dev/null \
  && echo '/.fi/' >>"$exclude"
echo "flashinfer_kit: $root/.fi: $(du -sh .fi | cut -f1) ($(du -sb .fi | cut -f1) bytes;" \
  "$(du -sh "$work/kit" | cut -f1) unpacked by env.sh); on the node: source .fi/env.sh"
