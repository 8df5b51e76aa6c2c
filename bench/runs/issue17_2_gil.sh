#!/usr/bin/env bash
# Issue 17.2 on one H200, under MPS (two ranks on one GPU time-slice without it): raw tcp
# writes against engine-like loads in the sender's process, polled vs blocking
# (wire_under_load.py), then the streamed PD overlap with the write timeline (the
# transport's blocking wait measured beside it at 3d38288 is gone). Usage: bash ... OUT_DIR
set -u
out=$1; shift
mkdir -p "$out"
. bench/runs/h200_env.sh "$out"
mps_on
q8b_model "$out"
timeout 200 python3 bench/experiments/wire_under_load.py --json "$out/wire_loads_mps.json" \
  --total-bytes $((512 << 20)) --repeats 1 --no-placements --writers sync,poll \
  --sender-loads matmul,small_kernels,graph_small_kernels,python_spin 2>&1 | grep "GB/s"
timeline_q8b "$out" poll 250 --num-prompts 3
mps_off
