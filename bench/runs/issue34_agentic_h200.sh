#!/usr/bin/env bash
# Issue 34's live run on one H200: one unified rank (qwen3-8b shapes, random bf16, L1 + L2
# L2_RATIO x L1 (default 4), write_through_selective) under `kvstrata bench --workload
# agentic` (8 root sessions at 0.1/s: 8k-token shared tool prefixes of 4 kinds,
# tool-result turns, lognormal pauses median 2 s / p99 660 s compressed 60x, sub-agent
# fan-out up to 4, 64-token answers), L1 = a quarter of the live sessions' working set as
# `kvstrata simulate` measures it on the same workload (41,840 tokens: 2,615 pages of 16);
# once with LRU and sessions off, once at default flags (priority eviction, paused
# sessions retained and demoted), same workload and seed. The simulator's prediction:
# kvstrata simulate --workload agentic --agentic-num-sessions 8 --agentic-session-rate 0.1
#   --agentic-time-scale 60 --agentic-turns 12 --agentic-max-fanout 4
#   --agentic-prefix-len 8000 --agentic-output-len 64 --seed 34 --page-size 16 --l2-ratio 4
# Prepare: bash bench/runs/fetch_h200_deps.sh; on the device, with carry [".whl", ".debs"]:
# [L2_RATIO=4] bash bench/runs/issue34_agentic_h200.sh [L1_PAGES] [extra bench flags]
set -u
out=${OUT:-/tmp/out}
. bench/runs/h200_env.sh "$out"
q8b_model "$out"
l1_pages=${1:-2624}  # 41,984 tokens of 16-token pages
l2_ratio=${L2_RATIO:-4}
shift || true
agentic=(--workload agentic --agentic-num-sessions 8 --agentic-session-rate 0.1
  --agentic-time-scale 60 --agentic-turns 12 --agentic-max-fanout 4 --agentic-prefix-len 8000
  --agentic-output-len 64 --seed 34 --max-concurrency 32 --max-duration-s 200 --no-progress)
run() {  # NAME [rank flags]
  local name=$1; shift
  python3 -m kvstrata serve --model /tmp/q8b --device cuda --port 30000 --page-size 16 \
    --num-kv-pages "$l1_pages" --max-model-len 40960 --enable-hierarchical-cache \
    --hicache-ratio "$l2_ratio" --hicache-write-policy write_through_selective --log-level warning \
    "$@" > "$out/$name-rank.log" 2>&1 &
  local pid=$!
  for _ in $(seq 180); do
    curl -sf localhost:30000/health > /dev/null && break
    kill -0 "$pid" 2> /dev/null || { tail -3 "$out/$name-rank.log"; return 1; }
    sleep 1
  done
  timeout 240 python3 -m kvstrata bench --url http://127.0.0.1:30000 "${agentic[@]}" \
    --label "$name" --output "$out/$name.json" "${EXTRA[@]}" > "$out/$name.txt" 2>&1
  curl -s localhost:30000/metrics | grep -E "^kvstrata_(hicache_(hit_tokens|demoted|undemoted|evicted|l2_retained)|session)" \
    > "$out/$name-metrics.txt"
  kill "$pid"; wait "$pid" 2>/dev/null
  echo "== $name"; grep -E "TTFT|resumed|pause|<1 s|1-10|10-60|>10|all" "$out/$name.txt" | cut -c1-200 | head -30
  cat "$out/$name-metrics.txt"
}
EXTRA=("$@")
run lru --radix-eviction-policy lru --session-paused-priority 0
run sessions
