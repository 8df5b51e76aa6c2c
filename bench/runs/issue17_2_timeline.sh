#!/usr/bin/env bash
# Issue 17.2 on one H200: the streamed PD overlap (bench/experiments/pd_overlap.py, own
# compute stream) with the write timeline on, without and with MPS, and where each write
# waited (bench/experiments/write_timeline_report.py). Usage: bash ... OUT_DIR [flags]
set -u
out=$1; shift
mkdir -p "$out"
. bench/runs/h200_env.sh "$out"
q8b_model "$out"
overlap() {  # NAME [pd_overlap flags]
  local name=$1; shift
  rm -rf "/tmp/tl_$name"
  KVSTRATA_WRITE_TIMELINE="/tmp/tl_$name" overlap_q8b 280 "$out/$name" --num-prompts 3 "$@" \
    2>&1 | filter 4
  python3 bench/experiments/write_timeline_report.py "/tmp/tl_$name" \
    --json "$out/$name/timeline.json" > "$out/$name/timeline.txt" 2>&1
  cut -c1-400 "$out/$name/timeline.txt"
}
overlap nomps "$@"
mps_on
overlap mps "$@"
mps_off
