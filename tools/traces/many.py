"""Scale program: N kernel launches (argv[1], default 1,000,000), each in its own push/pop range.

The launches loop in C (tricky_lib.cu, tl_many) so the trace is launch-bound, not Python-bound.

    usage: python tools/traces/many.py [N]   (under nsys, by tools/make_fixtures.sh many; needs a GPU)
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _tricky import check, load  # noqa: E402

if sys.argv[1:2] in (["-h"], ["--help"]):  # help only: nothing built, traced or written
    sys.exit(print(__doc__.strip()))
n = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
lib = load()
dom = lib.tl_domain(b"bench")
sid = lib.tl_register(dom, b"launch")
t0 = time.perf_counter()
check(lib.tl_many(n, dom, sid), "tl_many")
print(f"many: {n} launches in {time.perf_counter() - t0:.1f} s", flush=True)
