#!/usr/bin/env bash
# ncu details (speed of light, memory, warp states, occupancy, launch, warp instructions executed) of rlkernel's own
# kernels in one fused call, after warm-up calls; clocks left as they are (--clock-control none).
#   source .node-kit/env.sh && bash tools/ncu_ops.sh sample B V          # fp32 logits, top_k 50, top_p 0.9
#   source .node-kit/env.sh && bash tools/ncu_ops.sh logp N V DTYPE      # forward only
#   source .node-kit/env.sh && bash tools/ncu_ops.sh linear N H V LOGITS EPILOGUE   # linear_logp forward, every kernel
#     (cuBLAS GEMMs included) of one call; LOGITS bf16 | float32; EPILOGUE off | on (the epilogue GEMM, issue 37)
set -eu
case "${1:-}" in -h|--help) sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac  # help only: nothing run
op=${1:?usage: ncu_ops.sh sample B V | logp N V DTYPE | linear N H V LOGITS EPILOGUE}
if [ "$op" = linear ]; then
  # one forward after warm-up calls, between cudaProfilerStart / Stop: every kernel of that call, ours and cuBLAS's
  logits=${5:-bf16}; epi=${6:-off}
  case $logits in bf16) ld=None ;; float32) ld=torch.float32 ;; *) echo "ncu_ops.sh: LOGITS is bf16 or float32" >&2; exit 2 ;; esac
  case $epi in on) en=True ;; off) en=False ;; *) echo "ncu_ops.sh: EPILOGUE is on or off" >&2; exit 2 ;; esac
  exec ncu --clock-control none --profile-from-start off --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats python3 -c "
import torch, rlkernel
from rlkernel.ops.fused import epilogue_gemm
epilogue_gemm.ENABLED = $en
n, h, v = ${2:-16384}, ${3:-896}, ${4:-151936}
x = torch.randn(n, h, device='cuda', dtype=torch.bfloat16)
w = torch.randn(v, h, device='cuda', dtype=torch.bfloat16) / h ** 0.5
ids = torch.randint(0, v, (n,), device='cuda')
call = lambda: rlkernel.linear_logp(x, w, ids, return_entropy=True, logits_dtype=$ld, backend='fused', require_fused=True)
with torch.no_grad():
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
"
fi
case $op in
  sample) call="rlkernel.sample(x, top_k=50, top_p=0.9, backend='fused')"
          make="x = torch.randn(${2:-256}, ${3:-128256}, device='cuda') * 3"; per_call=2 ;;
  logp) call="rlkernel.logp(x, ids, backend='fused')"
        make="x = torch.randn(${2:-4096}, ${3:-32000}, device='cuda', dtype=torch.${4:-bfloat16}); ids = torch.randint(0, x.shape[1], (x.shape[0],), device='cuda')"
        per_call=1 ;;
  *) echo "ncu_ops.sh: unknown op $op (sample, logp, linear)" >&2; exit 2 ;;
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
