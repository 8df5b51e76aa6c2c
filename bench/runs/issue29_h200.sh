#!/usr/bin/env bash
# Issue 29.2 on one H200: the prefill rank's crash at 4096-token chunks (the Gatherer's
# buffers taken from blocks the compute stream freed with writers still queued). The GPU
# tests of every chunk size and write path first (most telling cases first), then, time
# permitting, bench/experiments/pd_l3_restore.py at its defaults, which crashed before.
# Prepare here: bash bench/runs/fetch_h200_deps.sh; then on the device, with carry
# [".whl", ".debs"]: bash bench/runs/issue29_h200.sh [tests|restore|all]
set -u
out=${OUT:-/tmp/out}
part=${1:-all}
mkdir -p "$out"
. bench/runs/h200_env.sh "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ "$part" = tests ] || [ "$part" = all ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_pd_chunks_gpu.py \
    -k "alias or 4096 or 8192" 2>&1 | tee "$out/chunks_first.log" | filter 6
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_pd_chunks_gpu.py \
    tests/gpu/test_transfer_gpu.py -k "not alias and not 4096 and not 8192" 2>&1 \
    | tee "$out/chunks_rest.log" | filter 6
fi
if [ "$part" = restore ] || [ "$part" = all ]; then
  q8b_model "$out"
  timeout 300 python3 bench/experiments/pd_l3_restore.py --model /tmp/q8b --device cuda \
    --transport mooncake --out "$out/restore" 2>&1 | filter 20
fi
