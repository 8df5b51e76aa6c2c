#!/usr/bin/env bash
# Issue 32 on 2 or 4 GPUs of one host (kind nvidia-h200-x2 / -x4; not lent in the session
# that wrote it): the TP GPU tests (NCCL, CUDA graphs with the all-reduces captured), then
# W1/W2 of bench/offline.py at TP 1 and TP N (qwen3-8b shapes, bf16): what TP buys a batch
# and a batch-1 decode on this model, against the roofline of N devices. Part `pd`: issue
# 16's multi-turn ablation (8 conversations x 5 rounds, 2k -> 16k tokens, 64 out, 2 in
# flight) with a TP N prefill rank and a TP N decode rank (ipc, then Mooncake tcp) against
# one unified TP N rank; on 2N GPUs each rank has its own, on N they share them (MPS).
# Prepare here: bash bench/runs/fetch_h200_deps.sh; then on the device, with carry
# [".whl", ".debs"]: bash bench/runs/issue32_multi_gpu.sh [N] [all|pd]
set -u
out=${OUT:-/tmp/out}
n=${1:-2}
part=${2:-all}
mkdir -p "$out"
. bench/runs/h200_env.sh "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ "$part" = pd ]; then
  gpus=$(nvidia-smi -L | wc -l)
  devices=""  # both ranks from cuda:0 unless there are 2N devices
  [ "$gpus" -ge $((2 * n)) ] && devices="--rank-devices cuda:0,cuda:$n"
  [ -z "$devices" ] && mps_on
  q8b_model "$out"
  for transport in ipc mooncake; do
    timeout 560 python3 bench/experiments/decode_hicache_ablation.py --model /tmp/q8b \
      --device cuda --transport "$transport" --settings l1l2,local,unified $devices \
      --num-clients 8 --num-rounds 5 --first-prompt-len 2048 --last-prompt-len 16384 \
      --output-len 64 --max-concurrency 2 --decode-l1-tokens 98304 \
      --out "$out/pd_tp${n}_$transport" --tp-size "$n" 2>&1 | grep -v "━━" | tail -40
  done
  [ -z "$devices" ] && mps_off
  exit 0
fi
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_tp_gpu.py 2>&1 \
  | tee "$out/tp_gpu.log" | tail -4
for tp in 1 "$n"; do
  timeout 500 python3 bench/offline.py --out "$out/offline_tp$tp.json" --workdir /tmp/kvb \
    --workloads W2,W1 --skip-transformers --tp-size "$tp" 2>&1 \
    | tee "$out/offline_tp$tp.log" | grep -E "^W[12]|engine up" | cut -c1-300
done
