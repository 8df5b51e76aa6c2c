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
python3 bench/experiments/wire_under_load.py --json "$out/wire_gpu.json" 2>&1 | filter 8
python3 bench/experiments/wire_under_load.py --dst-device cpu --json "$out/wire_cpu_dst.json" \
  2>&1 | filter 8
if command -v nvidia-cuda-mps-control > /dev/null; then
  mps_on
  python3 bench/experiments/wire_under_load.py --json "$out/wire_gpu_mps.json" 2>&1 | filter 8
  q8b_model "$out"
  overlap_q8b 300 "$out/mps" --num-prompts 4 2>&1 | filter 8
  mps_off
else
  echo "no nvidia-cuda-mps-control on this box"
fi
