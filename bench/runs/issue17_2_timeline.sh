#!/usr/bin/env bash
# Issue 17.2 on one H200: the streamed PD overlap (bench/experiments/pd_overlap.py, own
# compute stream) with the write timeline on, without and with MPS, and where each write
# waited (bench/experiments/write_timeline_report.py). Usage: bash ... OUT_DIR [flags]
set -u
out=$1; shift
mkdir -p "$out"
. bench/runs/h200_env.sh "$out"
q8b_model "$out"
timeline_q8b "$out" nomps 280 --num-prompts 3 "$@"
mps_on
timeline_q8b "$out" mps 280 --num-prompts 3 "$@"
mps_off
