#!/usr/bin/env bash
# ncu details (speed of light, memory, warp states, occupancy, launch, warp instructions executed) of rlkernel's own
# kernels in one fused call, after warm-up calls; clocks left as they are (--clock-control none).
#   source .node-kit/env.sh && bash tools/ncu_ops.sh sample B V          # fp32 logits, top_k 50, top_p 0.9
#   source .node-kit/env.sh && bash tools/ncu_ops.sh logp N V DTYPE      # forward only
set -eu
case "${1:-}" in -h|--help) sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac  # help only: nothing run
op=${1:?usage: ncu_ops.sh sample B V | logp N V DTYPE}
case $op in
  sample) call="rlkernel.sample(x, top_k=50, top_p=0.9, backend='fused')"
          make="x = torch.randn(${2:-256}, ${3:-128256}, device='cuda') * 3"; per_call=2 ;;
  logp) call="rlkernel.logp(x, ids, backend='fused')"
        make="x = torch.randn(${2:-4096}, ${3:-32000}, device='cuda', dtype=torch.${4:-bfloat16}); ids = torch.randint(0, x.shape[1], (x.shape[0],), device='cuda')"
        per_call=1 ;;
  *) echo "ncu_ops.sh: unknown op $op (sample, logp)" >&2; exit 2 ;;
esac
ncu --clock-control none -k regex:rlkernel_ --launch-skip $((2 * per_call)) --launch-count "$per_call" \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
  --section LaunchStats --section SchedulerStats --metrics dram__bytes_read.sum,dram__bytes_write.sum,smsp__inst_executed.sum \
  python3 -c "
import torch, rlkernel
$make
for _ in range(3):
    $call
torch.cuda.synchronize()
"
