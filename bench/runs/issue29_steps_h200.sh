#!/usr/bin/env bash
# Issue 29.1 on one H200: where the decode rank's time goes with its cache on. The decode
# HiCache ablation (issue 16's workload: 8 conversations x 5 rounds, 2k -> 16k tokens, 64
# out, 2 in flight, L1 49,152 tokens, Mooncake tcp) for SETTINGS (default off,l1,l1l2),
# printing each setting's decode-rank step counters (steps overlapped and synchronous, why
# overlap was lost, host seconds by part of the step: bench/experiments/common.py's
# step_counters). Prepare: bash bench/runs/fetch_h200_deps.sh; on the device, with carry
# [".whl", ".debs"]: bash bench/runs/issue29_steps_h200.sh [SETTINGS]
set -u
out=${OUT:-/tmp/out}
mkdir -p "$out"
. bench/runs/h200_env.sh "$out"
q8b_model "$out"
mps_on
timeout 540 python3 bench/experiments/decode_hicache_ablation.py --model /tmp/q8b --device cuda \
  --transport mooncake --settings "${1:-off,l1,l1l2}" --num-clients 8 --num-rounds 5 \
  --first-prompt-len 2048 --last-prompt-len 16384 --output-len 64 --max-concurrency 2 \
  --decode-l1-tokens 49152 --out "$out/ablation" 2>&1 | grep -v "━━" | filter 40
mps_off
