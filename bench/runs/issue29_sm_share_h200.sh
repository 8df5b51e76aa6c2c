#!/usr/bin/env bash
# Issue 29, the decode steps' stretch under MPS: issue 16's ablation workload (as
# issue29_targets_h200.sh) with the prefill rank's SMs capped by --mps-prefill-sm-percent
# for each PERCENT, beside the uncapped default, one call (the prefill rank's long prompt
# kernels then cannot hold every SM a decode step waits for; the price is its TTFT).
# Prepare: bash bench/runs/fetch_h200_deps.sh; on the device, with carry [".whl", ".debs"]:
# bash bench/runs/issue29_sm_share_h200.sh [SETTINGS] [PERCENTS]   (default off,l1l2 100,70,50)
set -u
out=${OUT:-/tmp/out}
. bench/runs/h200_env.sh "$out"
q8b_mps "$out"
settings=${1:-off,l1l2}
for percent in $(echo "${2:-100,70,50}" | tr , " "); do
  echo "== prefill rank at $percent% of the SMs"
  ablation16 290 "$out/sm$percent" --settings "$settings" --mps-prefill-sm-percent "$percent" \
    | grep -E "TTFT mean" | cut -c1-200
  rm -rf "$out/sm$percent/plots"
  for f in "$out/sm$percent"/*[+,]*; do mv "$f" "$(echo "$f" | tr "+," "__")"; done
  python3 bench/experiments/report_line.py "$out/sm$percent"/*.json
done
mps_off
