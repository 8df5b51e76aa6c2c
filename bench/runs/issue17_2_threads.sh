#!/usr/bin/env bash
# Issue 17.2 on one H200 under MPS: which threads of the ranks use the CPU while a streamed
# room's first write crawls (bench/experiments/thread_cpu.py beside pd_overlap.py, write
# timeline on), with the default thread pools and with OMP_NUM_THREADS=1.
# Usage: bash bench/runs/issue17_2_threads.sh OUT_DIR
set -u
out=$1; shift
mkdir -p "$out"
. bench/runs/h200_env.sh "$out"
mps_on
q8b_model "$out"
overlap() {  # NAME
  rm -rf "/tmp/tl_$1"; mkdir -p "$out/$1"
  python3 bench/experiments/thread_cpu.py --out "$out/$1/threads.json" --duration-s 170 \
    --pattern "kvstrata" &
  KVSTRATA_WRITE_TIMELINE="/tmp/tl_$1" overlap_q8b 170 "$out/$1" --num-prompts 3 2>&1 | filter 1
  python3 bench/experiments/write_timeline_report.py "/tmp/tl_$1" --json "$out/$1/timeline.json" \
    > /dev/null 2>&1
  wait
}
overlap default_threads
OMP_NUM_THREADS=1 overlap omp1
mps_off
