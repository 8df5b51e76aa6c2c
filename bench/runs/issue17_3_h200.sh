#!/usr/bin/env bash
# Issue 17.3 on one H200: turn-2 TTFT with the decode rank's L3 read serial vs beside the
# transfer (bench/experiments/pd_l3_restore.py), qwen3-8b shapes, Mooncake tcp, against
# classic PD and one unified rank; then the GPU PD tests.
# Usage: bash bench/runs/issue17_3_h200.sh OUT_DIR [pd_l3_restore flags]
set -u
out=$1; shift
mkdir -p "$out"
. bench/runs/h200_env.sh "$out"
[ -f /tmp/q8b/config.json ] || python3 -m kvstrata make-tiny-model /tmp/q8b --preset qwen3-8b \
  > "$out/model.log" 2>&1
timeout 420 python3 bench/experiments/pd_l3_restore.py --model /tmp/q8b --device cuda \
  --out "$out" "$@" 2>&1 | grep -v "^[IWE][0-9]" | tail -8
timeout 100 python3 -m pytest -q -rfE tests/gpu/test_pd_gpu.py > "$out/gpu_tests.txt" 2>&1
tail -3 "$out/gpu_tests.txt"
