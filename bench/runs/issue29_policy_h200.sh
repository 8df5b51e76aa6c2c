#!/usr/bin/env bash
# Issue 29.1 on one H200, next step: is the decode rank's L1+L2 TPOT gap the L2 backups'?
# Part `tests`: the GPU tests this session's change touches (TP on one GPU: NCCL group of
# one; PD and transfers at TP 1). Part `policy POLICY [SETTINGS]`: issue 16's ablation
# workload (as bench/runs/issue29_steps_h200.sh: qwen3-8b shapes, 1P+1D under MPS, Mooncake
# tcp, 8 conversations x 5 rounds, 2k -> 16k tokens, 64 out, 2 in flight, decode L1 49,152
# tokens, L2 2x) with --hicache-write-policy POLICY (write_through: every finished
# request's pages copied to L2 as they are computed; write_back: only on eviction).
# Prepare: bash bench/runs/fetch_h200_deps.sh; on the device, with carry [".whl", ".debs"]:
# bash bench/runs/issue29_policy_h200.sh tests | policy POLICY [SETTINGS]
set -u
out=${OUT:-/tmp/out}
part=${1:-tests}
mkdir -p "$out"
. bench/runs/h200_env.sh "$out"
if [ "$part" = tests ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_tp_gpu.py \
    tests/gpu/test_pd_gpu.py tests/gpu/test_transfer_gpu.py 2>&1 | tee "$out/tests.log" \
    | filter 12
  exit 0
fi
policy=${2:-write_through}
q8b_model "$out"
mps_on
ablation16 540 "$out/ablation_$policy" --settings "${3:-l1l2}" \
  --hicache-write-policy "$policy" | filter 40
mps_off
