#!/usr/bin/env bash
# Download, into .whl/ (git-ignored), the wheels radixserve needs that the H200 machines' image
# lacks. That machine has no network: the wheels travel with the working tree and
# scripts/gpu_run.sh installs them there. Its python is CPython 3.12 on x86-64.
#
# Already in that image (not fetched): torch, triton, transformers, tokenizers, safetensors,
# numpy, prometheus-client, httpx, aiohttp, idna, h11, click, tqdm, matplotlib, pytest,
# pytest-timeout, pytest-xdist, hypothesis, uvloop, pyyaml, annotated-doc.
#
#   bash scripts/gpu_wheels.sh          # then name .whl in the device call's carry list
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.whl
mkdir -p "$DEST"

# One version of each (two versions of one package stop the whole install there).
PACKAGES=(
  msgspec==0.23.0
  pyzmq==27.3.0
  fastapi==0.165.0
  starlette==1.10.0
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
  uvicorn==0.54.0
  httptools==0.9.0
  websockets==17.4
  python-dotenv==1.2.4
  opentelemetry-api==1.45.2
  anyio==4.16.0
  openai==3.57.0
  jiter==0.19.0
  sniffio==1.3.1
  httpx2==2.16.2
  httpcore2==2.16.2
  truststore==0.10.5
  xgrammar==0.2.9
  apache-tvm-ffi==0.1.15.post2
  py-spy==0.4.3                 # the engine's Python stacks during a run (gpu_agent_bench.sh PROFILE=1)
  jsonschema==4.26.0            # the structured-output tests validate against the schema
  jsonschema-specifications==2025.9.1
  referencing==0.37.0
  rpds-py==2026.9.1
  attrs==26.1.0
  fla-core==0.6.0               # Gated DeltaNet's chunked prefill for the hybrid models (pure Triton; einops is there)
)

PYTHON=${PYTHON:-python3}
for spec in "${PACKAGES[@]}"; do
  name=${spec%%==*}
  norm=$(echo "$name" | tr '-' '_')
  if compgen -G "$DEST/${norm}-${spec##*==}-*.whl" >/dev/null || compgen -G "$DEST/${name}-${spec##*==}-*.whl" >/dev/null; then
    continue
  fi
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_24_x86_64 \
    -d "$DEST" "$spec"
done
ls -l "$DEST"
du -sh "$DEST"
