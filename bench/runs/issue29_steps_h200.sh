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
. bench/runs/h200_env.sh "$out"
q8b_mps "$out"
ablation16 540 "$out/ablation" --settings "${1:-off,l1,l1l2}" | filter 40
mps_off
