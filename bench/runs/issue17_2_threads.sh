#!/usr/bin/env bash
# Issue 17.2 on one H200 under MPS: which threads of the ranks use the CPU while a streamed
# room's first write crawls (bench/experiments/thread_cpu.py beside pd_overlap.py, write
# timeline on), with the default thread pools and with OMP_NUM_THREADS=1.
# Usage: bash bench/runs/issue17_2_threads.sh OUT_DIR
set -u
out=$1; shift
mkdir -p "$out"
. bench/runs/h200_env.sh "$out"
filter() { grep -v "^[IWE][0-9]" | tail -"$1"; }
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d && echo "MPS on"
[ -f /tmp/q8b/config.json ] || python3 -m kvstrata make-tiny-model /tmp/q8b --preset qwen3-8b \
  > "$out/model.log" 2>&1
overlap() {  # NAME
  rm -rf "/tmp/tl_$1"; mkdir -p "$out/$1"
  python3 bench/experiments/thread_cpu.py --out "$out/$1/threads.json" --duration-s 170 \
    --pattern "kvstrata" &
  KVSTRATA_WRITE_TIMELINE="/tmp/tl_$1" timeout 170 python3 bench/experiments/pd_overlap.py \
    --model /tmp/q8b --device cuda --out "$out/$1" --transport mooncake --prompt-len 16384 \
    --num-prompts 3 --chunk-tokens 2048 --compute-stream own 2>&1 | filter 1
  python3 bench/experiments/write_timeline_report.py "/tmp/tl_$1" --json "$out/$1/timeline.json" \
    > /dev/null 2>&1
  wait
}
overlap default_threads
OMP_NUM_THREADS=1 overlap omp1
echo quit | nvidia-cuda-mps-control
