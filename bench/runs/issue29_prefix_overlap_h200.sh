#!/usr/bin/env bash
# Issue 29's prefill-HiCache target once a room's cached prefix streams before its suffix
# is computed: issue 16's ablation workload (qwen3-8b shapes, 1P+1D under MPS, Mooncake tcp,
# 8 conversations x 5 rounds, 2k -> 16k tokens, 64 out, 2 in flight, L1 49,152 tokens) over
# SETTINGS at L2 2x (the issue's command), then L1+L2 + prefill HiCache at L2 3x, where both
# ranks' L2 hold every conversation (what the 2x run loses to capacity). One call.
# Prepare: bash bench/runs/fetch_h200_deps.sh; on the device, with carry [".whl", ".debs"]:
# bash bench/runs/issue29_prefix_overlap_h200.sh [SETTINGS]
set -u
out=${OUT:-/tmp/out}
. bench/runs/h200_env.sh "$out"
q8b_mps "$out"
show() { grep -E "^│|^┃|TTFT mean|GB in" | cut -c1-260; }
ablation16 330 /tmp/r2x --settings "${1:-off,l1l2,prefill_hicache}" | show
ablation16 170 /tmp/r3x --settings prefill_hicache --decode-hicache-ratio 3 | show
mps_off
for f in /tmp/r2x/*.json /tmp/r3x/*.json; do
  case "$f" in */setup.json | */steps.json | */transfer.json) continue ;; esac
  name=$(basename "$(dirname "$f")")-$(basename "$f" | tr "+," "__")
  cp "$f" "$out/$name"
done
rm -f "$out/pip.log" "$out/model.log"
python3 bench/experiments/report_line.py "$out"/*.json
