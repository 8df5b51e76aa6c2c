# Issue 19 (sampling features) on one H200: CUDA parity of penalties / bias / min_tokens /
# logprobs / n / echo logprobs with CUDA graphs + overlap on against both off, and plain
# greedy decode throughput before (the tree of 639046e) and after. Prepare here:
#   mkdir -p build/p1-gpu/whl build/p1-gpu/old
#   cp .whl/{pydantic-2,pydantic_core,annotated_types,typing_extensions,typing_inspection}*.whl build/p1-gpu/whl/
#   git archive 639046e kvstrata | tar -x -C build/p1-gpu/old
# then run `bash bench/runs/issue19_sampling/run.sh` on the device with carry build/p1-gpu.
export PYTHONUNBUFFERED=1 KVSTRATA_SKIP_MOONCAKE=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
  build/p1-gpu/whl/*.whl > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
here=bench/runs/issue19_sampling
PYTHONPATH=/tmp/site:$PWD python3 $here/cuda_parity.py 2>&1 | grep -v Warning
PYTHONPATH=/tmp/site:$PWD python3 -c \
  "from kvstrata.model.tiny import make_tiny_model; make_tiny_model('/tmp/q06', preset='qwen3-0.6b')"
for i in 1 2 3; do
  PYTHONPATH=/tmp/site:$PWD/build/p1-gpu/old python3 $here/plain_speed.py /tmp/q06 before | tail -1
  PYTHONPATH=/tmp/site:$PWD python3 $here/plain_speed.py /tmp/q06 after | tail -1
done
PYTHONPATH=/tmp/site:$PWD python3 $here/plain_speed.py /tmp/q06 after penalties | tail -1
PYTHONPATH=/tmp/site:$PWD python3 $here/plain_speed.py /tmp/q06 after logprobs | tail -1
