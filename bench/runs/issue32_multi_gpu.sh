#!/usr/bin/env bash
# Issue 32 on 2 or 4 GPUs of one host (kind nvidia-h200-x2 / -x4; not lent in the session
# that wrote it): the TP GPU tests (NCCL, CUDA graphs with the all-reduces captured), then
# W1/W2 of bench/offline.py at TP 1 and TP N (qwen3-8b shapes, bf16): what TP buys a batch
# and a batch-1 decode on this model, against the roofline of N devices.
# Prepare here: bash bench/runs/fetch_h200_deps.sh; then on the device, with carry
# [".whl", ".debs"]: bash bench/runs/issue32_multi_gpu.sh [N]
set -u
out=${OUT:-/tmp/out}
n=${1:-2}
mkdir -p "$out"
. bench/runs/h200_env.sh "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_tp_gpu.py 2>&1 \
  | tee "$out/tp_gpu.log" | tail -4
for tp in 1 "$n"; do
  timeout 500 python3 bench/offline.py --out "$out/offline_tp$tp.json" --workdir /tmp/kvb \
    --workloads W2,W1 --skip-transformers --tp-size "$tp" 2>&1 \
    | tee "$out/offline_tp$tp.log" | grep -E "^W[12]|engine up" | cut -c1-300
done
