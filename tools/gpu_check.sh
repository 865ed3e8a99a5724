#!/usr/bin/env bash
# The hardware-profiling guide (docs/hardware-profiling.md), run on a GPU node from the project tree + node kit.
#
#   source .node-kit/env.sh && bash tools/gpu_check.sh [STAGE ...]
#
# Stages (default: all, in this order): node build tests profile grpo capture bench
# (and `example`: a small nsys capture of the log-prob workloads, analysed with --require-fused, the run tarred
# into the output folder: the analyzer's bundled example is made from it)
# Each stage takes a few minutes at most, so one device call can run one or a few of them. Each step's exit code
# is read per the contracts: 0 pass, 3 blocked (this machine lacks what it needs), anything else fail. Its own exit
# code: 1 when a step failed, else 3 when a step was blocked (nothing proved on this machine), else 0.
# Logs go to $OUT (or ./reports/gpu_check when OUT is unset): one log per step, bundled into logs.tgz, and
# summary.txt, a one-screen table of every step and the trace verdict of every fused workload.
set -u
case "${1:-}" in -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac  # help only: nothing run
known="node build tests profile grpo capture bench example"
stages=${*:-node build tests profile grpo capture bench}
for s in $stages; do  # every stage named is known before anything is made or run
  case " $known " in *" $s "*) ;; *) echo "gpu_check: unknown stage $s (known: $known; see --help)" >&2; exit 2 ;; esac
done
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${OUT:-$root/reports/gpu_check}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
logs=$scratch/logs  # outside $OUT: only logs.tgz and summary.txt go there
mkdir -p "$out" "$logs"
summary="$out/summary.txt"
: > "$logs/steps.tsv"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"  # scripts import the tree, installed or not
gpu=${CUDA_VISIBLE_DEVICES-0}  # set but empty (every GPU hidden) stays empty: the steps then say blocked
export CUDA_VISIBLE_DEVICES=$gpu

step() {  # step NAME COMMAND...: run, log, classify
  local name=$1; shift
  local t0=$SECONDS
  echo "== $name: $*"
  "$@" > "$logs/$name.log" 2>&1
  local rc=$?
  local verdict=fail
  [ $rc -eq 0 ] && verdict=pass
  [ $rc -eq 3 ] && verdict=blocked
  printf '%s\t%s\t%s\t%ss\t%s\n' "$name" "$verdict" "$rc" "$((SECONDS - t0))" "$*" >> "$logs/steps.tsv"
  tail -n 4 "$logs/$name.log" | sed 's/^/   /'
  echo "   -> $verdict (exit $rc, $((SECONDS - t0)) s)"
  return 0
}

has_cuda() { "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)' 2>/dev/null; }

stage_node() {
  if command -v nvidia-smi >/dev/null; then
    step nvidia-smi nvidia-smi
  else
    step nvidia-smi sh -c 'echo "blocked: nvidia-smi not found (no NVIDIA driver here)"; exit 3'
  fi
  step node-record "$py" -m rlkernel.env
  step select-gpu "$py" -c "import sys, torch; ok = torch.cuda.is_available(); print('cuda_available', ok, 'device_count', torch.cuda.device_count(), 'logical_device_0', torch.cuda.get_device_name(0) if ok else None); sys.exit(0 if ok else 3)"
}

stage_build() {
  if ! command -v nvcc >/dev/null || ! has_cuda; then
    step build sh -c 'echo "blocked: building rlkernel._C needs nvcc and a CUDA build of torch"; exit 3'
    return
  fi
  step build env MAX_JOBS=${MAX_JOBS:-16} "$py" setup.py build_ext --inplace
  step extension "$py" -c "import sys, rlkernel.env as e; x = e.describe()['extension']; print(x); sys.exit(0 if x['built'] else 1)"
}

stage_tests() {
  step test-dispatch "$py" -m pytest tests/test_dispatch.py -v
  step test-profiler "$py" -m pytest tests/test_profiler.py -v
  if has_cuda; then
    step test-gpu "$py" -m pytest -q tests/test_logp_fused.py tests/test_sampling_fused.py
  else
    step test-gpu sh -c 'echo "blocked: the fused-kernel tests need CUDA"; exit 3'
  fi
}

stage_profile() {
  step profile-smoke "$py" scripts/run_profile_suite.py --device cuda --dtype float32 --batch-sizes 2 --seq-lens 16 \
    --vocab-sizes 1024 --workloads logp-native,logp-fused,sampling-native --warmup 0 --repeat 1 \
    --output-dir reports/ampere-smoke --csv --json
  step profile-logp "$py" scripts/run_profile_suite.py --device cuda --dtype float16 --batch-sizes 8,16,32 \
    --seq-lens 128,512 --vocab-sizes 4096,128256 --workloads logp-native,logp-fused --warmup 5 --repeat 20 \
    --output-dir reports/ampere-logp --csv --json
  step profile-sampling "$py" scripts/run_profile_suite.py --device cuda --dtype float16 --batch-sizes 64,128,256 \
    --vocab-sizes 128256 --workloads sampling-native --top-k 50 --top-p 0.9 --warmup 5 --repeat 20 \
    --output-dir reports/ampere-sampling --csv --json
}

stage_grpo() {
  step grpo-strict "$py" examples/grpo_single_gpu.py --device cuda --require-fused-logp --steps 2 --num-prompts 1 \
    --samples-per-prompt 2 --prompt-len 2 --completion-len 3 --vocab-size 16 --hidden-dim 8
  step grpo-compare "$py" examples/grpo_single_gpu.py --device cuda --compare-backends --steps 20
}

after_capture() {  # after_capture CAPTURE_STEP NAME COMMAND...: analyse the run that capture just made (its last line)
  local verdict run name=$2
  verdict=$(awk -F'\t' -v s="$1" '$1 == s { v = $2 } END { print v }' "$logs/steps.tsv")
  run=$(tail -n 1 "$logs/$1.log")
  case $verdict in
    pass) [ -d "$run" ] || { step "$2" sh -c "echo 'not run: $1 printed no run directory'; exit 1"; return; }
          shift 2; step "$name" "$@" "$run" ;;
    blocked) step "$2" sh -c "echo 'blocked: $1 was blocked, so there is no new run to analyse'; exit 3" ;;
    *) step "$2" sh -c "echo 'not run: $1 failed'; exit 1" ;;
  esac
}

stage_capture() {  # the guide's commands (docs/hardware-profiling.md, sections 6 and 7)
  step capture-logp "$py" -m pipelines.capture --workload logp-native --workload logp-fused --tool all
  after_capture capture-logp analyze-logp "$py" -m pipelines.analyze
  step capture-grpo "$py" -m pipelines.capture --workload grpo-step
  after_capture capture-grpo analyze-grpo "$py" -m pipelines.analyze --require-fused
}

stage_example() {
  step capture-example "$py" -m pipelines.capture --workload logp-native --workload logp-fused \
    --workload logp-fused-bwd --batch-size 2 --seq-len 64 --vocab-size 4096 --warmup 2 --repeat 3 --output-dir runs
  after_capture capture-example analyze-example "$py" -m pipelines.analyze --require-fused
  local run
  run=$(tail -n 1 "$logs/capture-example.log")
  [ -d "$run" ] && tar czf "$out/example_run.tgz" "$run"
}

stage_bench() {
  step bench-nvtx "$py" benchmarks/bench_nvtx_overhead.py
  step bench-logp "$py" benchmarks/bench_logp.py
  step bench-sampling "$py" benchmarks/bench_sampling.py
}

runs_before=$(ls -d runs/*/ 2>/dev/null | sort)
echo "gpu_check: stages [$stages], CUDA_VISIBLE_DEVICES=$gpu, logs in $logs"
for s in $stages; do
  "stage_$s"
done

# Trace verdicts of the fused workloads, from the analyzer's dispatch.csv of each run this call made.
new_runs=$(comm -13 <(echo "$runs_before") <(ls -d runs/*/ 2>/dev/null | sort))
verdicts=$(for r in $new_runs; do csv="${r}report/dispatch.csv"; [ -f "$csv" ] && awk -F, -v run="$(basename "$r")" \
  'NR > 1 && $1 == "workload" { v[$2] = v[$2] " " $5 } END { for (k in v) print "   " run ": " k " ->" v[k] }' "$csv"; done)
{
  echo "gpu_check summary ($(date -u +%FT%TZ), CUDA_VISIBLE_DEVICES=$gpu)"
  printf '%-18s %-8s %-5s %-6s %s\n' step result exit time command
  awk -F'\t' '{ printf "%-18s %-8s %-5s %-6s %.70s\n", $1, $2, $3, $4, $5 }' "$logs/steps.tsv"
  echo "trace verdicts of fused workloads:"
  echo "${verdicts:-   (no analyzed runs)}"
} > "$summary"
tar czf "$out/logs.tgz" -C "$(dirname "$logs")" logs 2>/dev/null
cat "$summary"
grep -q $'\tfail\t' "$logs/steps.tsv" && exit 1
grep -q $'\tblocked\t' "$logs/steps.tsv" && exit 3
exit 0
