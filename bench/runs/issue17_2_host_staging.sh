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
staged() { timeline_q8b "$out" "$1" 170 --num-prompts 3 --mooncake-config "$HOST_STAGING"; }
staged host_staging
mps_on
staged host_staging_mps
mps_off
