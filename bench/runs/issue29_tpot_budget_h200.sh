#!/usr/bin/env bash
# Issue 29 on one H200: local prefill's TPOT against its budget. Issue 16's ablation
# workload (qwen3-8b shapes, 1P+1D under MPS, Mooncake tcp, 8 conversations x 5 rounds, 2k
# -> 16k tokens, 64 out, 2 in flight, decode L1 49,152 tokens, L2 2x): decode cache off,
# local prefill at default flags (--disaggregation-decode-local-prefill-tpot-budget 0.08)
# and one unified rank, in one run; then local prefill with the budget off (1), the
# behaviour before.
# Prepare: bash bench/runs/fetch_h200_deps.sh; on the device, with carry [".whl", ".debs"]:
# bash bench/runs/issue29_tpot_budget_h200.sh [SETTINGS]
set -u
out=${OUT:-/tmp/out}
. bench/runs/h200_env.sh "$out"
q8b_mps "$out"
ablation() {  # NAME LIMIT_S [flags]
  local name=$1 limit_s=$2; shift 2
  ablation16 "$limit_s" "$out/$name" "$@" | grep -E "^│|TTFT mean" | cut -c1-260
}
echo "== default (budget 0.08)"; ablation budget 330 --settings "${1:-off,local,unified}"
echo "== budget off"; ablation nobudget 150 --settings local \
  --disaggregation-decode-local-prefill-tpot-budget 1
mps_off
for d in "$out"/*/; do rm -rf "$d/plots"; for f in "$d"*[+,]*; do mv "$f" "$(echo "$f" | tr "+," "__")"; done; done
python3 bench/experiments/report_line.py "$out"/budget/*.json "$out"/nobudget/*.json
