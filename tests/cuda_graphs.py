"""What the CUDA-graph tests share: PyTorch's documented warm-up before a capture."""
from __future__ import annotations

import torch


def warm_on_side_stream(fn, times: int = 2) -> None:
    """Run ``fn`` ``times`` times on a side stream (allocator pools and lazy init happen there, not in the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(times):
            fn()
    torch.cuda.current_stream().wait_stream(side)
