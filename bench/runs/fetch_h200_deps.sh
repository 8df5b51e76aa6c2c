#!/usr/bin/env bash
# Fetches, on this (networked) box, what the H200 image lacks, into the ignored folders
# the run scripts carry: .whl (Python 3.12 wheels: the server stack, gguf, Mooncake's CUDA 13
# Transfer Engine, xgrammar, jsonschema for the grammar tests) and .debs (the system
# libraries Mooncake links). Then a device call names ".whl" and ".debs" in carry and
# sources bench/runs/h200_env.sh.
# Usage: bash bench/runs/fetch_h200_deps.sh [--no-mooncake]
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl .debs
wheels=(
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5
  annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5
  typing-extensions==4.16.0 opentelemetry-api==1.45.2 uvicorn==0.54.0 gguf==0.19.0
  xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 jsonschema==4.26.0
  jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0
)
[ "${1:-}" = --no-mooncake ] || wheels+=(mooncake-transfer-engine-cuda13)
platforms=()
for n in 2_28 2_27 2_24 2_17 2_35 2_34 2_31; do platforms+=(--platform "manylinux_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" --platform manylinux2014_x86_64 -d .whl "${wheels[@]}"
if [ "${1:-}" != --no-mooncake ]; then
  (cd .debs && apt-get download -q libibverbs1 librdmacm1 libnuma1 libnl-3-200 libnl-route-3-200)
fi
du -sh .whl .debs
