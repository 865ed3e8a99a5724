"""usage: `measure.py LABEL CMD ...`: run CMD, print wall seconds and peak RSS of its largest descendant.

Peak RSS is RUSAGE_CHILDREN.ru_maxrss: the largest resident set of any waited-for descendant
(not a sum), which is what a memory limit on the biggest worker would see.
"""
import resource
import subprocess
import sys
import time

if sys.argv[1:2] in (["-h"], ["--help"]):  # help only: nothing built, traced or written
    sys.exit(print(__doc__.strip()))
label, cmd = sys.argv[1], sys.argv[2:]
t0 = time.perf_counter()
rc = subprocess.call(cmd)
wall = time.perf_counter() - t0
rss_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
print(f"MEASURE {label}: rc={rc} wall_s={wall:.2f} peak_rss_mb={rss_mb:.0f}", flush=True)
sys.exit(rc)
