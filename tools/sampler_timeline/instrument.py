"""Copy csrc/ and insert timeline probes into the sampler's kernels, for tools/sampler_timeline.sh.

    python tools/sampler_timeline/instrument.py SRC_CSRC DST_DIR

The probes (thread 0 of each block, into __device__ arrays that driver.cu reads back):
  candidates block: %globaltimer at its start and at the end of each chunk it filters (up to 19), its SM;
  select block: clock64 at its start (0), past cudaGridDependencySynchronize (1), after the counts' scan (2), after
  staging the candidates (3), after top_by_threshold (4), after finish_sorted (5), and %globaltimer at 1 and 5.
Each probe is placed at an anchor line of csrc/include/rlkernel/sampling_kernels.cuh; an anchor that is missing or
not unique stops the copy with exit code 1 (tests/test_sampler_timeline.py keeps them in step with the kernels).
The product is never built with them: only the copy is.
"""
from __future__ import annotations

import pathlib
import shutil
import sys

KERNELS = "include/rlkernel/sampling_kernels.cuh"

PROBES = r"""
__device__ unsigned long long rlk_tl_cand[2048][20];
__device__ unsigned int rlk_tl_cand_sm[2048];
__device__ int rlk_tl_cand_n[2048];
__device__ long long rlk_tl_sel[512][8];
__device__ unsigned long long rlk_tl_sel_g[512][2];
__device__ unsigned int rlk_tl_sel_sm[512];
__device__ __forceinline__ unsigned long long rlk_gtime() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned rlk_smid() {
  unsigned s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}
#define RLK_TL_CAND_START if (threadIdx.x == 0) { rlk_tl_cand[blockIdx.x][0] = rlk_gtime(); \
  rlk_tl_cand_sm[blockIdx.x] = rlk_smid(); }
#define RLK_TL_CAND_CHUNK(it) if (threadIdx.x == 0 && (it) < 19) { rlk_tl_cand[blockIdx.x][(it) + 1] = rlk_gtime(); \
  rlk_tl_cand_n[blockIdx.x] = (it) + 1; }
#define RLK_TL_SEL(i) if (threadIdx.x == 0 && blockIdx.x < 512) { rlk_tl_sel[blockIdx.x][i] = clock64(); \
  if ((i) == 1) { rlk_tl_sel_g[blockIdx.x][0] = rlk_gtime(); rlk_tl_sel_sm[blockIdx.x] = rlk_smid(); } \
  if ((i) == 5) rlk_tl_sel_g[blockIdx.x][1] = rlk_gtime(); }
"""

# (anchor, probe, before): the probe goes right after the anchor, or right before it when `before`
PLACES = [
    ("namespace sampling {\n", PROBES, False),
    ("  if (begin >= end) return;\n", "  RLK_TL_CAND_START\n", False),
    ("    const int row = cur.row;\n    cur.next(splits);\n", "    RLK_TL_CAND_CHUNK(it)\n", True),
    ("  __shared__ SelectSmem sm;\n", "  RLK_TL_SEL(0)\n", False),
    ("  cudaGridDependencySynchronize();\n#endif\n", "  RLK_TL_SEL(1)\n", False),
    ("  const uint32_t before = block_exclusive_scan<kRowThreads>(c, sm.scan, &total);\n", "  RLK_TL_SEL(2)\n", False),
    ("  const int m = top_by_threshold(sm,", "  RLK_TL_SEL(3)\n", True),
    ("  if (m > 0) {\n", "    RLK_TL_SEL(4)\n", False),
    ("    const KeptStats k = finish_sorted<kMode>(sm.sorted, m, args, sm.finish);\n", "    RLK_TL_SEL(5)\n", False),
]


def instrument(text: str) -> str:
    for anchor, probe, before in PLACES:
        n = text.count(anchor)
        if n != 1:
            raise ValueError(f"anchor found {n} times, wanted once: {anchor!r}")
        text = text.replace(anchor, probe + anchor if before else anchor + probe)
    return text


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    src, dst = pathlib.Path(argv[0]), pathlib.Path(argv[1])
    try:
        probed = instrument((src / KERNELS).read_text())
    except (OSError, ValueError) as e:
        print(f"instrument: {e}", file=sys.stderr)
        return 1
    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    (tmp / KERNELS).write_text(probed)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    print(f"instrument: probed copy of {src} in {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
