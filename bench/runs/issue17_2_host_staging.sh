#!/usr/bin/env bash
# Issue 17.2 on one H200: the streamed PD overlap with the decode rank's staging in pinned
# host memory ({"host_staging": true}: the Transfer Engine's tcp io thread copies no GPU
# memory on the decode side), without MPS; the transport's GPU tests; the PD and engine GPU
# tests of this tree; then the same overlap under MPS. Usage: bash ... OUT_DIR
set -u
out=$1; shift
mkdir -p "$out"
. bench/runs/h200_env.sh "$out"
filter() { grep -v "^[IWE][0-9]" | tail -"$1"; }
[ -f /tmp/q8b/config.json ] || python3 -m kvstrata make-tiny-model /tmp/q8b --preset qwen3-8b \
  > "$out/model.log" 2>&1
HOST='{"metadata_server": "P2PHANDSHAKE", "protocol": "tcp", "host_staging": true}'
overlap() {  # NAME
  timeout 170 python3 bench/experiments/pd_overlap.py --model /tmp/q8b --device cuda \
    --out "$out/$1" --transport mooncake --prompt-len 16384 --num-prompts 3 --chunk-tokens 2048 \
    --compute-stream own --mooncake-config "$HOST" 2>&1 | filter 4
}
overlap host_staging
timeout 100 python3 -m pytest -q -rfE tests/gpu/test_transfer_gpu.py tests/gpu/test_pd_gpu.py \
  tests/gpu/test_engine_gpu.py > "$out/gpu_tests.txt" 2>&1; tail -3 "$out/gpu_tests.txt"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d && echo "MPS on"
overlap host_staging_mps
echo quit | nvidia-cuda-mps-control
