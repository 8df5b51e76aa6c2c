# Issue 27 (containment) on one H200: the GPU containment tests (a NaN row refused without
# a device-side assert; a real device-side assert ends the rank with status 70), the GPU
# suite, and decode throughput before (HEAD's tree) and after on qwen3-0.6b shapes,
# greedy, sampled and seeded. Prepare here (wheels as bench/runs/h200_env.sh lists, no
# Mooncake needed):
#   mkdir -p build/i27/old && git archive ccf999d kvstrata | tar -x -C build/i27/old
# then on the device, with carry [".whl", "build/i27"]: bash bench/runs/issue27_h200/run.sh
# tests (the GPU tests), then bash bench/runs/issue27_h200/run.sh speed (the throughput).
export PYTHONUNBUFFERED=1 KVSTRATA_SKIP_MOONCAKE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
speed=bench/runs/issue19_sampling/plain_speed.py  # its sampled and seeded modes are issue 27's
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ "$1" = tests ]; then
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_containment_gpu.py \
  2>&1 | tee "$OUT/gpu_containment.log" | grep -E "passed|failed|Error|assert" | tail -8
timeout 300 python3 -m pytest -q -p no:cacheprovider -x tests/gpu --ignore \
  tests/gpu/test_containment_gpu.py 2>&1 | tee "$OUT/gpu_suite.log" | tail -4
exit 0
fi
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_containment_gpu.py tests/gpu/test_draw_gpu.py tests/gpu/test_engine_gpu.py 2>&1 | tail -2
python3 -c "from kvstrata.model.tiny import make_tiny_model; \
  make_tiny_model('/tmp/q06', preset='qwen3-0.6b')" > /dev/null
for mode in plain sampled seeded; do
  for i in 1 2; do
    PYTHONPATH=/tmp/site:$PWD/build/i27/old timeout 120 python3 $speed /tmp/q06 before $mode | tail -1
    timeout 120 python3 $speed /tmp/q06 after $mode | tail -1
  done
done 2>&1 | tee "$OUT/decode_speed.txt"
