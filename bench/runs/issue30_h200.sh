#!/usr/bin/env bash
# Issue 30 on one H200: constrained decoding's GPU test (xgrammar's CUDA bitmask under CUDA
# graphs against eager), then its cost: a json_schema on every request of a 32-request
# decode batch against the same batch unconstrained (target: +5%), and the compile times
# of the test set's schemas, on qwen3-8b shapes (random bf16 weights, kvstrata's trained
# tokenizer padded to qwen3's vocabulary of 151,936).
# Prepare here: bash bench/runs/fetch_h200_deps.sh; then on the device, with carry
# [".whl", ".debs"]: bash bench/runs/issue30_h200.sh
set -u
out=${OUT:-/tmp/out}
mkdir -p "$out"
. bench/runs/h200_env.sh "$out"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_grammar_gpu.py 2>&1 \
  | tee "$out/grammar_gpu.log" | tail -3
q8b_model "$out"
timeout 240 python3 bench/structured_output.py --model /tmp/q8b --out "$out/structured_q8b.json" \
  2>&1 | tee "$out/structured_q8b.log" | tail -5
