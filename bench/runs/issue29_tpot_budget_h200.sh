#!/usr/bin/env bash
# Issue 29 on one H200: local prefill's TPOT against --disaggregation-decode-local-prefill-
# tpot-budget. Issue 16's ablation workload (qwen3-8b shapes, 1P+1D under MPS, Mooncake
# tcp, 8 conversations x 5 rounds, 2k -> 16k tokens, 64 out, 2 in flight, decode L1 49,152
# tokens, L2 2x): decode cache off, local prefill and one unified rank at default flags
# (no budget), then local prefill at each budget of BUDGETS.
# Prepare: bash bench/runs/fetch_h200_deps.sh; on the device, with carry [".whl", ".debs"]:
# bash bench/runs/issue29_tpot_budget_h200.sh [BUDGETS, default "0.08 0.12"]
set -u
out=${OUT:-/tmp/out}
. bench/runs/h200_env.sh "$out"
q8b_mps "$out"
ablation16 200 "$out/default" --settings off,local,unified >/dev/null 2>&1
python3 bench/experiments/report_line.py "$out"/default/*.json
for budget in ${1:-0.08 0.12}; do
  ablation16 150 "$out/b$budget" --settings local \
    --disaggregation-decode-local-prefill-tpot-budget "$budget" >/dev/null 2>&1
  echo "budget $budget"; python3 bench/experiments/report_line.py "$out"/b"$budget"/*.json
done
mps_off
for d in "$out"/*/; do rm -rf "$d/plots"; for f in "$d"*[+,]*; do mv "$f" "$(echo "$f" | tr "+," "__")"; done; done
