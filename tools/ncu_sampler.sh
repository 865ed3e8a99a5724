#!/usr/bin/env bash
# ncu details (speed of light, memory, warp states, occupancy) of the fused sampler's two kernels for one call
# at B rows of V fp32 logits, top_k 50, top_p 0.9; clocks left as they are (--clock-control none).
#   source .node-kit/env.sh && bash tools/ncu_sampler.sh [B] [V]
set -eu
b=${1:-256}; v=${2:-128256}
ncu --clock-control none -k regex:rlkernel_sample --launch-skip 4 --launch-count 2 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
  --section LaunchStats --section SchedulerStats \
  python3 -c "
import torch, rlkernel
x = torch.randn($b, $v, device='cuda') * 3
for _ in range(3):
    rlkernel.sample(x, top_k=50, top_p=0.9, backend='fused')
torch.cuda.synchronize()
"
