#!/usr/bin/env bash
# Issue 29.3, one call: the 12-in-flight load (qwen3-8b shapes, 1P+1D under MPS on one
# H200, Mooncake tcp, 24 conversations x 4 rounds, 1k -> 8k tokens, 128 out, L1 131,072
# tokens): PD at default flags (local prefill auto) and one unified rank, then PD with
# every prompt prefilled on the decode rank (threshold above any prompt): what the path
# choice costs on a GPU the prefill rank shares. Each cluster is warmed up before its run.
# Prepare: bash bench/runs/fetch_h200_deps.sh; on the device, with carry [".whl", ".debs"]:
# bash bench/runs/issue29_load_h200.sh
set -u
out=${OUT:-/tmp/out}
. bench/runs/h200_env.sh "$out"
q8b_mps "$out"
show() { grep -E "^│|^┃|TTFT mean|GB in" | cut -c1-260; }
load="--num-clients 24 --num-rounds 4 --first-prompt-len 1024 --last-prompt-len 8192
  --output-len 128 --max-concurrency 12 --decode-l1-tokens 131072"
# shellcheck disable=SC2086
ablation16 200 /tmp/load --settings local,unified $load | show
# shellcheck disable=SC2086
ablation16 110 /tmp/all_local --settings local --local-prefill threshold \
  --disaggregation-decode-local-prefill-max-tokens 1000000 $load | show
mps_off
for f in /tmp/load/*.json /tmp/all_local/*.json; do
  case "$f" in */setup.json | */steps.json | */transfer.json) continue ;; esac
  cp "$f" "$out/$(basename "$(dirname "$f")")-$(basename "$f" | tr "+," "__")"
done
rm -f "$out/pip.log" "$out/model.log"
python3 bench/experiments/report_line.py "$out"/*.json
