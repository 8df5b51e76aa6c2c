#!/usr/bin/env bash
# Issue 17.2 on one H200, under MPS (two ranks on one GPU time-slice without it): raw tcp
# writes against engine-like loads in the sender's process, polled vs blocking
# (wire_under_load.py), then the streamed PD overlap with the transport's polled and
# blocking waits, with the write timeline. Usage: bash bench/runs/issue17_2_gil.sh OUT_DIR
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
timeout 200 python3 bench/experiments/wire_under_load.py --json "$out/wire_loads_mps.json" \
  --total-bytes $((512 << 20)) --repeats 1 --no-placements --writers sync,poll \
  --sender-loads matmul,small_kernels,graph_small_kernels,python_spin 2>&1 | grep "GB/s"
overlap() {  # NAME MOONCAKE_CONFIG
  rm -rf "/tmp/tl_$1"
  KVSTRATA_WRITE_TIMELINE="/tmp/tl_$1" timeout 250 python3 bench/experiments/pd_overlap.py \
    --model /tmp/q8b --device cuda --out "$out/$1" --transport mooncake --prompt-len 16384 \
    --num-prompts 3 --chunk-tokens 2048 --compute-stream own --mooncake-config "$2" 2>&1 | filter 4
  python3 bench/experiments/write_timeline_report.py "/tmp/tl_$1" --json "$out/$1/timeline.json" \
    > "$out/$1/timeline.txt" 2>&1; head -3 "$out/$1/timeline.txt" | cut -c1-300
}
overlap block '{"metadata_server": "P2PHANDSHAKE", "protocol": "tcp", "wait": "block"}'
overlap poll '{"metadata_server": "P2PHANDSHAKE", "protocol": "tcp"}'
echo quit | nvidia-cuda-mps-control
