#!/usr/bin/env bash
# Issue 31 on one H200: FP8 KV pages. `tests`: the fp8 kernel and engine tests in
# tests/gpu (and the attention, fused-op and engine tests the kernels' changes touch), then
# W2 (batch-1 decode, qwen3-8b shapes) at a 32k context with bf16 and fp8 KV. `ablation
# KV`: issue 16's decode HiCache ablation (8 conversations x 5 rounds, 2k -> 16k tokens,
# 64 out, 2 in flight, Mooncake tcp, MPS) for off, l1l2 and local with KV dtype KV (auto or
# fp8) and the same L1 bytes: 49,152 bf16 tokens or 98,304 fp8 tokens (L2 2x in pages).
# Prepare here: bash bench/runs/fetch_h200_deps.sh; then on the device, with carry
# [".whl", ".debs"]: bash bench/runs/issue31_h200.sh tests | kernels | w2 | overlap | ablation auto|fp8 [SETTINGS]
set -u
out=${OUT:-/tmp/out}
part=${1:-tests}
mkdir -p "$out"
. bench/runs/h200_env.sh "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ "$part" = tests ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_fp8_kv_gpu.py -s \
    2>&1 | tee "$out/fp8_gpu.log" | grep -E "vs bf16|passed|failed|Error|assert" | tail -30
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_triton_attention.py \
    tests/gpu/test_fused_ops.py tests/gpu/test_engine_gpu.py tests/gpu/test_copier.py 2>&1 \
    | tee "$out/kernels_gpu.log" | tail -4
  timeout 170 python3 bench/offline.py --out "$out/w2_32k.json" --workdir /tmp/kvb \
    --workloads W2 --skip-transformers --kv-cache-dtype auto,fp8 --w2-context 32768 2>&1 \
    | tee "$out/w2_32k.log" | grep -E "^W2|engine up|roofline" | cut -c1-400
fi
if [ "$part" = ablation ]; then
  kv=${2:-auto}
  l1=49152
  [ "$kv" = fp8 ] && l1=98304
  q8b_model "$out"
  mps_on
  timeout 560 python3 bench/experiments/decode_hicache_ablation.py --model /tmp/q8b \
    --device cuda --transport mooncake --settings "${3:-off,l1l2,local}" --num-clients 8 \
    --num-rounds 5 --first-prompt-len 2048 --last-prompt-len 16384 --output-len 64 \
    --max-concurrency 2 --decode-l1-tokens "$l1" --kv-cache-dtype "$kv" \
    --out "$out/ablation_$kv" 2>&1 | grep -v "━━" | filter 40
  mps_off
fi
if [ "$part" = kernels ]; then  # the fp8 decode kernel against bf16, per tile config
  timeout 200 python3 bench/kernels.py ${2:-decode_fp8} 2>&1 | tee "$out/kernels_fp8.log" | tail -12
fi
if [ "$part" = w2 ]; then  # the fp8 GPU tests, then W2 at 32k with bf16 and fp8 KV
  timeout 100 python3 -m pytest -q -p no:cacheprovider -s tests/gpu/test_fp8_kv_gpu.py 2>&1 \
    | tee "$out/fp8_gpu.log" | grep -E "vs bf16|^E |passed|failed" | head -30
  timeout 150 python3 bench/offline.py --out "$out/w2_32k.json" --workdir /tmp/kvb \
    --workloads W2 --skip-transformers --kv-cache-dtype auto,fp8 --w2-context 32768 2>&1 \
    | tee "$out/w2_32k.log" | grep -E "^W2" | cut -c1-300
fi
if [ "$part" = overlap ]; then  # one room's transfer and streamed TTFT, bf16 then fp8 KV
  q8b_model "$out"
  mps_on
  for kv in auto fp8; do
    overlap_q8b 170 "$out/overlap_$kv" --num-prompts 3 --kv-cache-dtype "$kv" 2>&1 \
      | filter 8
  done
  mps_off
fi
