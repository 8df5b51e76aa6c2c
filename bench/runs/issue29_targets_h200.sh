#!/usr/bin/env bash
# Issue 29's targets on one H200, at default flags (the prefill rank at MPS below-normal
# priority since --mps-client-priority auto): issue 16's ablation workload (qwen3-8b shapes,
# 1P+1D under MPS, Mooncake tcp, 8 conversations x 5 rounds, 2k -> 16k tokens, 64 out, 2
# in flight, decode L1 49,152 tokens, L2 2x) over SETTINGS (default: decode cache off, L1,
# L1+L2, L1+L2 + prefill HiCache, local prefill, one unified rank), one call.
# Prepare: bash bench/runs/fetch_h200_deps.sh; on the device, with carry [".whl", ".debs"]:
# bash bench/runs/issue29_targets_h200.sh [SETTINGS] [extra flags]
set -u
out=${OUT:-/tmp/out}
. bench/runs/h200_env.sh "$out"
q8b_mps "$out"
settings=${1:-off,l1,l1l2,prefill_hicache,local,unified}
shift || true
ablation16 580 "$out/targets" --settings "$settings" "$@" \
  | grep -E "^│|^┃|TTFT mean|GB in" | cut -c1-260
mps_off
rm -rf "$out/targets/plots"
for f in "$out"/targets/*[+,]*; do mv "$f" "$(echo "$f" | tr "+," "__")"; done
python3 bench/experiments/report_line.py "$out"/targets/*.json
