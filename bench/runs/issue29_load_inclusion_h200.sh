#!/usr/bin/env bash
# Issue 29, one call: (1) the 12-in-flight load (24 conversations x 4 rounds, 1k -> 8k
# tokens, 128 out, L1 131,072 tokens), PD at default flags against one unified rank;
# (2) issue 16's ablation workload, decode cache off and L1+L2 with the L2 non-inclusive
# (default) and inclusive (--hicache-inclusion inclusive on both ranks): what the copies
# an L1 eviction owes cost the decode steps.
# Prepare: bash bench/runs/fetch_h200_deps.sh; on the device, with carry [".whl", ".debs"]:
# bash bench/runs/issue29_load_inclusion_h200.sh
set -u
out=${OUT:-/tmp/out}
. bench/runs/h200_env.sh "$out"
q8b_mps "$out"
show() { grep -E "^│|^┃|TTFT mean|GB in" | cut -c1-260; }
ablation16 200 /tmp/load --settings local,unified --num-clients 24 --num-rounds 4 \
  --first-prompt-len 1024 --last-prompt-len 8192 --output-len 128 --max-concurrency 12 \
  --decode-l1-tokens 131072 | show
ablation16 190 /tmp/ni --settings off,l1l2 | show
ablation16 110 /tmp/incl --settings l1l2 --hicache-inclusion inclusive | show
mps_off
for f in /tmp/load/*.json /tmp/ni/*.json /tmp/incl/*.json; do
  case "$f" in */setup.json | */steps.json | */transfer.json) continue ;; esac
  cp "$f" "$out/$(basename "$(dirname "$f")")-$(basename "$f" | tr "+," "__")"
done
rm -f "$out/pip.log" "$out/model.log"
python3 bench/experiments/report_line.py "$out"/*.json
