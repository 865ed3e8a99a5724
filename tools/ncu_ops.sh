#!/usr/bin/env bash
# ncu details (speed of light, memory, warp states, occupancy, launch, warp instructions executed) of the kernels of
# one fused call (rlkernel's own; linear and linear-bwd: every kernel, cuBLAS's included), after warm-up calls; clocks
# left as they are (--clock-control none).
#   source .node-kit/env.sh && bash tools/ncu_ops.sh sample B V [DTYPE] [LOGPROBS]   # top_k 50, top_p 0.9;
#     DTYPE float32 (default) | bfloat16; LOGPROBS none (default) | raw (return_logprobs=True) | processed
#   source .node-kit/env.sh && bash tools/ncu_ops.sh logp N V DTYPE      # forward only
#   source .node-kit/env.sh && bash tools/ncu_ops.sh linear N H V LOGITS EPILOGUE   # linear_logp forward, every kernel
#     (cuBLAS GEMMs included) of one call; LOGITS bf16 | float32; EPILOGUE off | on | pingpong | cluster (the
#     epilogue GEMM of issue 37 in its cooperative, ping-pong or 2 x 1 cluster config)
#   source .node-kit/env.sh && bash tools/ncu_ops.sh linear-bwd N H V EPILOGUE   # one linear_logp backward (bf16,
#     float32 logits), every kernel of it: EPILOGUE on (default: the gradient epilogue GEMM, cooperative) | off
#     (cuBLAS float32 tile + grad kernel) | pingpong | tile (the epilogue forward, its gradient epilogue off)
#   source .node-kit/env.sh && bash tools/ncu_ops.sh processed N H V TOP_K TOP_P   # linear_logp's processed forward
#     (issue 39), bf16: every rlkernel kernel of one call (the cuBLAS tiles left out)
set -eu
case "${1:-}" in -h|--help) sed -n '2,/^set -eu/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;; esac  # help only: nothing run
op=${1:?usage: ncu_ops.sh sample B V [DTYPE] [LOGPROBS] | logp N V DTYPE | linear N H V LOGITS EPILOGUE | linear-bwd N H V EPILOGUE | processed N H V TOP_K TOP_P}
# one fused linear_logp forward (bf16 N x H x V, with entropy) after warm-up calls, between cudaProfilerStart / Stop
linear_script() {  # N H V EXTRA_KWARGS PRELUDE
  cat <<EOF
import torch, rlkernel
$5
n, h, v = $1, $2, $3
x = torch.randn(n, h, device='cuda', dtype=torch.bfloat16)
w = torch.randn(v, h, device='cuda', dtype=torch.bfloat16) / h ** 0.5
ids = torch.randint(0, v, (n,), device='cuda')
call = lambda: rlkernel.linear_logp(x, w, ids, return_entropy=True, backend='fused', require_fused=True, $4)
with torch.no_grad():
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
EOF
}
if [ "$op" = linear ]; then  # every kernel of the call, ours and cuBLAS's
  logits=${5:-bf16}; epi=${6:-off}
  case $logits in bf16) ld=None ;; float32) ld=torch.float32 ;; *) echo "ncu_ops.sh: LOGITS is bf16 or float32" >&2; exit 2 ;; esac
  case $epi in on) en=True; cfg=0 ;; pingpong) en=True; cfg=1 ;; cluster) en=True; cfg=2 ;; off) en=False; cfg=0 ;;
    *) echo "ncu_ops.sh: EPILOGUE is off, on, pingpong or cluster" >&2; exit 2 ;; esac
  exec ncu --clock-control none --profile-from-start off --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy \
    --section LaunchStats python3 -c "$(linear_script "${2:-16384}" "${3:-896}" "${4:-151936}" "logits_dtype=$ld" \
      "from rlkernel.ops.fused import epilogue_gemm; epilogue_gemm.ENABLED = $en; epilogue_gemm.CONFIG = $cfg")"
fi
if [ "$op" = linear-bwd ]; then  # the backward's kernels only: the forward runs before cudaProfilerStart
  case ${5:-on} in on) en=True; cfg=0; gr=True ;; pingpong) en=True; cfg=1; gr=True ;; tile) en=True; cfg=0; gr=False ;;
    off) en=False; cfg=0; gr=True ;; *) echo "ncu_ops.sh: EPILOGUE is off, on, pingpong or tile" >&2; exit 2 ;; esac
  exec ncu --clock-control none --profile-from-start off --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats \
    python3 -c "
import torch, rlkernel
from rlkernel.ops.fused import epilogue_gemm
epilogue_gemm.ENABLED, epilogue_gemm.CONFIG, epilogue_gemm.GRAD = $en, $cfg, $gr
n, h, v = ${2:-16384}, ${3:-896}, ${4:-151936}
x = torch.randn(n, h, device='cuda', dtype=torch.bfloat16, requires_grad=True)
w = (torch.randn(v, h, device='cuda', dtype=torch.bfloat16) / h ** 0.5).requires_grad_()
ids = torch.randint(0, v, (n,), device='cuda')
step = lambda: rlkernel.linear_logp(x, w, ids, return_entropy=True, backend='fused', require_fused=True,
                                    logits_dtype=torch.float32)
for _ in range(2):
    lp, ent = step(); (lp.sum() + ent.sum()).backward()
lp, ent = step(); loss = lp.sum() + ent.sum()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
loss.backward()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
print('gradient epilogue records:', epilogue_gemm.grad_records())
"
fi
if [ "$op" = processed ]; then  # rlkernel's kernels only (the per-block GEMMs are cuBLAS's, left out)
  exec ncu --clock-control none --profile-from-start off -k regex:rlkernel_ --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats \
    --section SchedulerStats --section InstructionStats python3 -c "$(linear_script \
      "${2:-16384}" "${3:-4096}" "${4:-128256}" "top_k=${5:-1024}, top_p=${6:-0.9}" "")"
fi
case $op in
  sample) case ${5:-none} in none) lp=False ;; raw) lp=True ;; processed) lp="'processed'" ;;
            *) echo "ncu_ops.sh: LOGPROBS is none, raw or processed" >&2; exit 2 ;; esac
          case ${4:-float32} in float32|bfloat16|float16) ;; *) echo "ncu_ops.sh: DTYPE is float32, bfloat16 or float16" >&2; exit 2 ;; esac
          call="rlkernel.sample(x, top_k=50, top_p=0.9, return_logprobs=$lp, backend='fused')"
          make="x = (torch.randn(${2:-256}, ${3:-128256}, device='cuda') * 3).to(torch.${4:-float32})"; per_call=2 ;;
  logp) call="rlkernel.logp(x, ids, backend='fused')"
        make="x = torch.randn(${2:-4096}, ${3:-32000}, device='cuda', dtype=torch.${4:-bfloat16}); ids = torch.randint(0, x.shape[1], (x.shape[0],), device='cuda')"
        per_call=1 ;;
  *) echo "ncu_ops.sh: unknown op $op (sample, logp, linear, linear-bwd, processed)" >&2; exit 2 ;;
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
