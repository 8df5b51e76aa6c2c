#!/usr/bin/env bash
# Issue 17.2 on one H200: the streamed PD overlap with both ends' staging in pinned host
# memory ({"host_staging": true}: no Transfer Engine tcp io thread copies GPU memory),
# after the transport's, PD and engine GPU tests of this tree; without MPS, then under it,
# each with the write timeline on. Usage: bash bench/runs/issue17_2_host_staging.sh OUT_DIR
set -u
out=$1; shift
mkdir -p "$out"
. bench/runs/h200_env.sh "$out"
q8b_model "$out"
timeout 100 python3 -m pytest -q -rfE tests/gpu/test_transfer_gpu.py tests/gpu/test_pd_gpu.py \
  tests/gpu/test_engine_gpu.py > "$out/gpu_tests.txt" 2>&1; tail -3 "$out/gpu_tests.txt"
HOST='{"metadata_server": "P2PHANDSHAKE", "protocol": "tcp", "host_staging": true}'
staged() {  # NAME: pd_overlap with host staging and the write timeline
  rm -rf "/tmp/tl_$1"
  KVSTRATA_WRITE_TIMELINE="/tmp/tl_$1" overlap_q8b 170 "$out/$1" --num-prompts 3 \
    --mooncake-config "$HOST" 2>&1 | filter 4
  python3 bench/experiments/write_timeline_report.py "/tmp/tl_$1" \
    --json "$out/$1/timeline.json" > "$out/$1/timeline.txt" 2>&1
  cut -c1-300 "$out/$1/timeline.txt" | head -20
}
staged host_staging
mps_on
staged host_staging_mps
mps_off
