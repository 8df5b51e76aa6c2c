#!/usr/bin/env bash
# Issue 7 follow-up on an H200: every GPU test (parity of the overlapped schedule, kernels,
# graphs, PD over CUDA IPC incl. two GPUs when present), then the offline workloads with the
# overlapped decode schedule on and off, each on an engine of its own, in one process.
# Usage: bash bench/runs/issue7_overlap.sh OUT_DIR
set -u
out=$1
mkdir -p "$out"
export PYTHONUNBUFFERED=1 KVSTRATA_SKIP_MOONCAKE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout 270 python3 -m pytest -q -rfE tests/gpu > "$out/gpu_tests.txt" 2>&1
grep -E "passed|failed|FAILED|ERROR" "$out/gpu_tests.txt" | tail -15
python3 bench/offline.py --out "$out/offline.json" --workloads W3,W2,W1 \
  --overlap-schedule on,off 2>&1 | grep -E "^(W[123]|roofline|qwen3)" | cut -c1-400
