"""Fixture program: kernels and copies, no NVTX at all (the export has no NVTX_EVENTS rows)."""
import torch

x = torch.randn(1 << 14, device="cuda")
for _ in range(3):
    x.mul_(1.01)
y = x.cpu()
torch.cuda.synchronize()
print("no_nvtx done", float(y[0]))
