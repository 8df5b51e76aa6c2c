#!/usr/bin/env bash
# Issue 34's live run on one H200: one unified rank (qwen3-8b shapes, random bf16, L1 + L2
# 1x, write_through_selective) under `kvstrata bench --workload agentic` (synthetic agent
# sessions: 16k-token shared tool prefixes of 4 kinds, tool-result turns, lognormal pauses
# median 2 s / p99 660 s compressed 60x, sub-agent fan-out), L1 sized for about a quarter
# of the live sessions' contexts; once with LRU and sessions off, once at default flags
# (priority eviction, paused sessions retained and demoted), same workload and seed.
# Prepare: bash bench/runs/fetch_h200_deps.sh; on the device, with carry [".whl", ".debs"]:
# bash bench/runs/issue34_agentic_h200.sh [L1_PAGES] [extra bench flags]
set -u
out=${OUT:-/tmp/out}
. bench/runs/h200_env.sh "$out"
q8b_model "$out"
l1_pages=${1:-8192}  # 131,072 tokens of 16-token pages
shift || true
agentic=(--workload agentic --agentic-num-sessions 24 --agentic-session-rate 0.5
  --agentic-time-scale 60 --agentic-turns 12 --agentic-max-fanout 8 --seed 34
  --max-concurrency 32 --max-duration-s 170 --no-progress)
run() {  # NAME [rank flags]
  local name=$1; shift
  python3 -m kvstrata serve --model /tmp/q8b --device cuda --port 30000 --page-size 16 \
    --num-kv-pages "$l1_pages" --max-model-len 40960 --enable-hierarchical-cache \
    --hicache-ratio 1 --hicache-write-policy write_through_selective --log-level warning \
    "$@" > "$out/$name-rank.log" 2>&1 &
  local pid=$!
  for _ in $(seq 180); do
    curl -sf localhost:30000/health > /dev/null && break
    kill -0 "$pid" 2> /dev/null || { tail -3 "$out/$name-rank.log"; return 1; }
    sleep 1
  done
  timeout 200 python3 -m kvstrata bench --url http://127.0.0.1:30000 "${agentic[@]}" \
    --label "$name" --output "$out/$name.json" "${EXTRA[@]}" > "$out/$name.txt" 2>&1
  curl -s localhost:30000/metrics | grep -E "^kvstrata_(hicache_(hit_tokens|demoted|evicted|l2_retained)|session)" \
    > "$out/$name-metrics.txt"
  kill "$pid"; wait "$pid" 2>/dev/null
  echo "== $name"; grep -E "TTFT|resumed|pause|<1 s|1-10|10-60|>10|all" "$out/$name.txt" | cut -c1-200 | head -30
  cat "$out/$name-metrics.txt"
}
EXTRA=("$@")
run lru --radix-eviction-policy lru --session-paused-priority 0
run sessions
