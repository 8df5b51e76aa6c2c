#!/usr/bin/env bash
# Issue 29.1 on one H200: the decode rank's GPU time step by step, decode cache off against
# L1+L2. Issue 16's ablation workload (qwen3-8b shapes, 1P+1D under MPS, Mooncake tcp, 8
# conversations x 5 rounds, 2k -> 16k tokens, 64 out, 2 in flight, decode L1 49,152
# tokens, L2 2x) with --profile-window START,LENGTH: both ranks run the torch profiler over
# that window of each setting's run (/start_profile), and trace_steps.py gives, per decode
# step, its compute-stream busy time and span, the side streams' copies over it, and the
# prefill rank's kernels over it (OUT/ablation/steps-LABEL.json).
# Prepare: bash bench/runs/fetch_h200_deps.sh; on the device, with carry [".whl", ".debs"]:
# bash bench/runs/issue29_profile_h200.sh [SETTINGS] [START_S,LENGTH_S]
set -u
out=${OUT:-/tmp/out}
. bench/runs/h200_env.sh "$out"
q8b_mps "$out"
ablation16 560 "$out/ablation" --settings "${1:-off,l1l2}" --profile-window "${2:-14,2}" \
  | filter 40
mps_off
