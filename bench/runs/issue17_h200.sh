#!/usr/bin/env bash
# Issue 17.2 on one H200: streamed vs serial PD writes of cold 16k-token prompts (qwen3-8b
# shapes, Mooncake tcp) against compute and transfer alone (bench/experiments/pd_overlap.py),
# and the GGUF loader on CUDA (a tiny GGUF against its safetensors original, bf16).
# Usage: bash bench/runs/issue17_h200.sh OUT_DIR [pd_overlap flags]
set -u
out=$1; shift
mkdir -p "$out"
. bench/runs/h200_env.sh "$out"
python3 - > "$out/gguf_cuda.txt" 2>&1 <<'PY'
import sys, tempfile; sys.path[:0] = ["tests/unit", "tests"]
from test_gguf import write_gguf
from kvstrata.model.tiny import make_tiny_model
from kvstrata import LLM, SamplingParams
d = make_tiny_model(tempfile.mkdtemp() + "/t", "llama"); g = write_gguf(d, d.parent / "t.gguf")
p = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True); ids = [[5, 6, 7, 8, 9, 10, 11, 12]]
a = LLM(str(d), device="cuda", dtype="bfloat16", num_kv_pages=64).generate(input_ids=ids, sampling_params=p)[0].output_ids
b = LLM(str(g), device="cuda", dtype="bfloat16", num_kv_pages=64).generate(input_ids=ids, sampling_params=p)[0].output_ids
print("gguf on cuda, bf16, greedy ids equal to safetensors:", a == b, a, b)
PY
tail -1 "$out/gguf_cuda.txt"
timeout 240 python3 -m pytest -q -rfE tests/gpu/test_pd_gpu.py tests/gpu/test_engine_gpu.py \
  > "$out/gpu_tests.txt" 2>&1; tail -3 "$out/gpu_tests.txt"
[ -f /tmp/q8b/config.json ] || python3 -m kvstrata make-tiny-model /tmp/q8b --preset qwen3-8b \
  > "$out/model.log" 2>&1
python3 bench/experiments/pd_overlap.py --model /tmp/q8b --device cuda --out "$out" "$@" 2>&1 \
  | grep -v "^[IWE][0-9]" | tail -12
