#!/usr/bin/env bash
# Issue 10 on a two-GPU machine (nvidia-h200-x2): the P2P peak and the ipc transport's
# cross-GPU write, the GPU PD tests (incl. prefill and decode on different GPUs), then the
# decode HiCache ablation with qwen3-8b shapes, prefill rank on cuda:0 and decode rank on
# cuda:1. Usage: bash bench/runs/issue10_x2.sh OUT_DIR SETTINGS [extra ablation flags]
set -u
out=$1; settings=$2; shift 2
mkdir -p "$out"
export PYTHONUNBUFFERED=1 KVSTRATA_SKIP_MOONCAKE=1
# Multicast stays off on shared hosts (device README).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ ! -f "$out/p2p.json" ]; then
  nvidia-smi topo -m > "$out/topo.txt" 2>&1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$out/topo.txt"
  python3 bench/p2p_bandwidth.py --json "$out/p2p.json" > "$out/p2p.log" 2>&1
  cat "$out/p2p.json"
  timeout 240 python3 -m pytest -q tests/gpu/test_pd_gpu.py 2>&1 | tail -4 | tee "$out/gpu_tests.txt"
fi
[ -f /tmp/q8b/config.json ] || python3 -m kvstrata make-tiny-model /tmp/q8b --preset qwen3-8b
python3 bench/experiments/decode_hicache_ablation.py --model /tmp/q8b \
  --rank-devices cuda:0,cuda:1 --settings "$settings" --num-rounds 5 \
  --last-prompt-len 24576 --out "$out/ablation" "$@" 2>&1 | tail -40
