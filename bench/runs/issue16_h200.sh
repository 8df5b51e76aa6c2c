#!/usr/bin/env bash
# Issues 16 and 17 on one H200: the decode HiCache ablation with local prefill and
# prefill-side reuse against classic PD and one unified rank, qwen3-8b shapes, over the
# Mooncake Transfer Engine (tcp) or ipc; part "transfer" measures raw Transfer Engine
# bandwidth against the mooncake transport (bench/transfer_bandwidth.py) first.
# The box lacks fastapi/uvicorn/pydantic and Mooncake: carry .whl (wheels) and .debs
# (libibverbs1 librdmacm1 libnuma1 from `apt-get download`).
# Usage: bash bench/runs/issue16_h200.sh OUT_DIR TRANSPORT SETTINGS [transfer|tests|-]
#        [extra ablation or rank flags]
set -u
out=$1; transport=$2; settings=$3; part=${4:--}; shift $(( $# < 4 ? $# : 4 ))
mkdir -p "$out"
. bench/runs/h200_env.sh "$out"
if [ "$part" = transfer ]; then
  timeout 200 python3 bench/transfer_bandwidth.py --device cuda --json "$out/transfer.json" \
    > "$out/transfer.log" 2>&1; tail -25 "$out/transfer.log"
fi
if [ "$part" = tests ]; then
  timeout 240 python3 -m pytest -q -rfE tests/gpu/test_pd_gpu.py tests/gpu/test_transfer_gpu.py \
    > "$out/gpu_tests.txt" 2>&1; tail -4 "$out/gpu_tests.txt"
fi
[ -f /tmp/q8b/config.json ] || python3 -m kvstrata make-tiny-model /tmp/q8b --preset qwen3-8b \
  > "$out/model.log" 2>&1
python3 bench/experiments/decode_hicache_ablation.py --model /tmp/q8b --device cuda \
  --transport "$transport" --settings "$settings" --num-clients 8 --num-rounds 5 \
  --first-prompt-len 2048 --last-prompt-len 16384 --output-len 64 --max-concurrency 2 \
  --decode-l1-tokens 49152 --out "$out/ablation" "$@" 2>&1 | grep -v "━━" | tail -40
tar -C "$out" -czf "$out/ablation.tgz" ablation && rm -rf "$out/ablation"
