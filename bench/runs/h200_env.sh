# Sourced by the H200 run scripts: the packages the box lacks, carried in the working tree
# as .whl (fastapi, uvicorn, pydantic, Mooncake's cuda13 wheel, gguf, ...) and .debs
# (libibverbs1 librdmacm1 libnuma1 from `apt-get download`). Usage: . bench/runs/h200_env.sh OUT
mkdir -p "$1"
export PYTHONUNBUFFERED=1 KVSTRATA_SKIP_MOONCAKE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl > "$1/pip.log" 2>&1 || { tail -5 "$1/pip.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
mkdir -p /tmp/debs && for f in .debs/*.deb; do dpkg -x "$f" /tmp/debs; done
export LD_LIBRARY_PATH=/tmp/debs/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
python3 -c "import mooncake.engine, fastapi, uvicorn; print('mooncake + fastapi import ok')" \
  || exit 1

# Shared by the run scripts that source this file.
filter() { grep -v "^[IWE][0-9]" | tail -"$1"; }  # Mooncake's glog lines out, last N lines
mps_on() {  # two ranks on one GPU run side by side only under MPS (docs/results.md, 17.2)
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && echo "MPS on"
}
mps_off() { echo quit | nvidia-cuda-mps-control; }
q8b_model() {  # OUT: the random qwen3-8b-shaped model at /tmp/q8b, made once per box
  [ -f /tmp/q8b/config.json ] || python3 -m kvstrata make-tiny-model /tmp/q8b \
    --preset qwen3-8b > "$1/model.log" 2>&1
}
overlap_q8b() {  # LIMIT_S OUT_DIR [pd_overlap flags]: cold 16k prompts, 2k chunks, tcp
  local limit_s=$1 dir=$2; shift 2
  timeout "$limit_s" python3 bench/experiments/pd_overlap.py --model /tmp/q8b --device cuda \
    --out "$dir" \
    --transport mooncake --prompt-len 16384 --chunk-tokens 2048 --compute-stream own "$@"
}
HOST_STAGING='{"metadata_server": "P2PHANDSHAKE", "protocol": "tcp", "host_staging": true}'
timeline_q8b() {  # OUT NAME LIMIT_S [pd_overlap flags]: overlap_q8b with the write timeline
  local out=$1 name=$2 limit_s=$3; shift 3
  rm -rf "/tmp/tl_$name"
  KVSTRATA_WRITE_TIMELINE="/tmp/tl_$name" overlap_q8b "$limit_s" "$out/$name" "$@" \
    2>&1 | filter 4
  python3 bench/experiments/write_timeline_report.py "/tmp/tl_$name" \
    --json "$out/$name/timeline.json" > "$out/$name/timeline.txt" 2>&1
  tar -czf "$out/$name/timeline_raw.tgz" -C /tmp "tl_$name"
  cut -c1-300 "$out/$name/timeline.txt" | head -24
}
ablation16() {  # LIMIT_S OUT_DIR [ablation flags]: issue 16's workload on /tmp/q8b, tcp
  local limit_s=$1 dir=$2; shift 2
  timeout "$limit_s" python3 bench/experiments/decode_hicache_ablation.py --model /tmp/q8b \
    --device cuda --transport mooncake --num-clients 8 --num-rounds 5 \
    --first-prompt-len 2048 --last-prompt-len 16384 --output-len 64 --max-concurrency 2 \
    --decode-l1-tokens 49152 --out "$dir" "$@" 2>&1 | grep -v "━━"
}
q8b_mps() {  # OUT: the random qwen3-8b model, then MPS on (two ranks on the GPU)
  q8b_model "$1"
  mps_on
}
