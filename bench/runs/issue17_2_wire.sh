#!/usr/bin/env bash
# Issue 17.2 on one H200: does the tcp wire stall while the GPU computes? Raw Transfer Engine
# bandwidth across processes with the GPU idle / busy in the sender, the receiver or a third
# process (bench/experiments/wire_under_load.py), into GPU and into host memory; then the
# same and the streamed PD overlap under MPS, if the box has nvidia-cuda-mps-control.
# Usage: bash bench/runs/issue17_2_wire.sh OUT_DIR
set -u
out=$1; shift
mkdir -p "$out"
. bench/runs/h200_env.sh "$out"
filter() { grep -v "^[IWE][0-9]" | tail -"$1"; }
python3 bench/experiments/wire_under_load.py --json "$out/wire_gpu.json" 2>&1 | filter 8
python3 bench/experiments/wire_under_load.py --dst-device cpu --json "$out/wire_cpu_dst.json" \
  2>&1 | filter 8
if command -v nvidia-cuda-mps-control > /dev/null; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d && echo "MPS on"
  python3 bench/experiments/wire_under_load.py --json "$out/wire_gpu_mps.json" 2>&1 | filter 8
  [ -f /tmp/q8b/config.json ] || python3 -m kvstrata make-tiny-model /tmp/q8b --preset qwen3-8b \
    > "$out/model.log" 2>&1
  timeout 300 python3 bench/experiments/pd_overlap.py --model /tmp/q8b --device cuda \
    --out "$out/mps" --transport mooncake --prompt-len 16384 --num-prompts 4 --chunk-tokens 2048 \
    --compute-stream own 2>&1 | filter 8
  echo quit | nvidia-cuda-mps-control
else
  echo "no nvidia-cuda-mps-control on this box"
fi
