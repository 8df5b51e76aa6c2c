#!/usr/bin/env bash
# Issue 10 on nvidia-h200-x2, second part: GPU PD tests (incl. the transport kernel's
# parity across GPUs), the P2P peak against the transport's kernel and torch paths, then
# the routing comparison with qwen3-8b shapes: prefill rank on cuda:0, three decode ranks
# on cuda:1 (the x4 layout, 1P + 3D on separate GPUs, is not lent).
# Usage: bash bench/runs/issue10_x2_routing.sh OUT_DIR [extra routing flags]
set -u
out=$1; shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 KVSTRATA_SKIP_MOONCAKE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout 240 python3 -m pytest -q -rA tests/gpu/test_pd_gpu.py > "$out/gpu_tests.txt" 2>&1
grep -E "passed|failed|PASSED|FAILED|Error" "$out/gpu_tests.txt" | tail -12
python3 bench/p2p_bandwidth.py --json "$out/p2p.json" > "$out/p2p.log" 2>&1; cat "$out/p2p.json"
[ -f /tmp/q8b/config.json ] || python3 -m kvstrata make-tiny-model /tmp/q8b --preset qwen3-8b
python3 bench/experiments/routing_comparison.py --model /tmp/q8b --workloads multiturn \
  --methods round_robin,cache_aware,ttft --num-decode 3 \
  --rank-devices cuda:0,cuda:1,cuda:1,cuda:1 --out "$out/routing" "$@" 2>&1 | tail -25
