# Sourced by the H200 run scripts: the packages the box lacks, carried in the working tree
# as .whl (fastapi, uvicorn, pydantic, Mooncake's cuda13 wheel, gguf, ...) and .debs
# (libibverbs1 librdmacm1 libnuma1 from `apt-get download`). Usage: . bench/runs/h200_env.sh OUT
export PYTHONUNBUFFERED=1 KVSTRATA_SKIP_MOONCAKE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl > "$1/pip.log" 2>&1 || { tail -5 "$1/pip.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
mkdir -p /tmp/debs && for f in .debs/*.deb; do dpkg -x "$f" /tmp/debs; done
export LD_LIBRARY_PATH=/tmp/debs/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
python3 -c "import mooncake.engine, fastapi, uvicorn; print('mooncake + fastapi import ok')" \
  || exit 1
