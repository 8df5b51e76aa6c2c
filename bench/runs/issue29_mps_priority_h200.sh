#!/usr/bin/env bash
# Issue 29.1 on one H200: does the decode rank keep its step time when the prefill rank
# sharing its GPU runs at MPS below-normal priority (--mps-client-priority auto, the
# default) rather than normal (the behaviour before)? Issue 16's ablation workload
# (qwen3-8b shapes, 1P+1D under MPS, Mooncake tcp, 8 conversations x 5 rounds, 2k -> 16k
# tokens, 64 out, 2 in flight, decode L1 49,152 tokens, L2 2x), settings off and l1l2, both
# ways, in one call; then one profiled l1l2 run (trace_steps.py) with the default.
# Prepare: bash bench/runs/fetch_h200_deps.sh; on the device, with carry [".whl", ".debs"]:
# bash bench/runs/issue29_mps_priority_h200.sh [SETTINGS]
set -u
out=${OUT:-/tmp/out}
. bench/runs/h200_env.sh "$out"
q8b_mps "$out"
ablation() {  # NAME [flags]
  local name=$1; shift
  ablation16 300 "$out/$name" "$@" | grep -E "^│|steps-|TTFT mean|overlapped" | cut -c1-260
}
settings=${1:-off,l1l2}
echo "== default: prefill rank below_normal"; ablation auto --settings "$settings"
echo "== both ranks normal"; ablation normal --settings "$settings" --mps-client-priority normal
echo "== profiled, default"; ablation profiled --settings l1l2 --profile-window 14,2
mps_off
for d in "$out"/*/; do rm -rf "$d/plots"; for f in "$d"*+*; do mv "$f" "${f//+/_}"; done; done
