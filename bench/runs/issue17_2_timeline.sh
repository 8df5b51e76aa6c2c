#!/usr/bin/env bash
# Issue 17.2 on one H200: the streamed PD overlap (bench/experiments/pd_overlap.py, own
# compute stream) with the write timeline on, without and with MPS, and where each write
# waited (bench/experiments/write_timeline_report.py). Usage: bash ... OUT_DIR [flags]
set -u
out=$1; shift
mkdir -p "$out"
. bench/runs/h200_env.sh "$out"
filter() { grep -v "^[IWE][0-9]" | tail -"$1"; }
[ -f /tmp/q8b/config.json ] || python3 -m kvstrata make-tiny-model /tmp/q8b --preset qwen3-8b \
  > "$out/model.log" 2>&1
overlap() {  # NAME
  rm -rf "/tmp/tl_$1"
  KVSTRATA_WRITE_TIMELINE="/tmp/tl_$1" timeout 280 python3 bench/experiments/pd_overlap.py \
    --model /tmp/q8b --device cuda --out "$out/$1" --transport mooncake --prompt-len 16384 \
    --num-prompts 3 --chunk-tokens 2048 --compute-stream own "$@" 2>&1 | filter 4
  python3 bench/experiments/write_timeline_report.py "/tmp/tl_$1" --json "$out/$1/timeline.json" \
    > "$out/$1/timeline.txt" 2>&1; cat "$out/$1/timeline.txt" | cut -c1-400
}
overlap nomps "$@"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d && echo "MPS on"
overlap mps "$@"
echo quit | nvidia-cuda-mps-control
