"""Fixture program: kernels and copies, no NVTX at all (the export has no NVTX_EVENTS rows).

    usage: python tools/traces/no_nvtx.py   (under nsys, by tools/make_fixtures.sh; needs a GPU)
"""
import sys

import torch

if sys.argv[1:2] in (["-h"], ["--help"]):  # help only: nothing built, traced or written
    sys.exit(print(__doc__.strip()))

x = torch.randn(1 << 14, device="cuda")
for _ in range(3):
    x.mul_(1.01)
y = x.cpu()
torch.cuda.synchronize()
print("no_nvtx done", float(y[0]))
