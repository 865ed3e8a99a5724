"""Fixture program: NVTX ranges and no CUDA work (the export has no CUPTI tables).

    usage: python tools/traces/no_cuda.py   (under nsys, by tools/make_fixtures.sh; builds tricky_lib.cu with nvcc)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _tricky import load  # noqa: E402

if sys.argv[1:2] in (["-h"], ["--help"]):  # help only: nothing built, traced or written
    sys.exit(print(__doc__.strip()))
lib = load()
dom = lib.tl_domain(b"cpu_only")
for _ in range(2):
    lib.tl_push_inline(0, b"host_work")
    lib.tl_push_inline(dom, b"inner")
    sum(range(10000))
    lib.tl_pop(dom)
    lib.tl_pop(0)
print("no_cuda done")
