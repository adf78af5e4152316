#!/usr/bin/env bash
# The prefix of every command run on the H200 machines, from the repository root:
#
#   bash scripts/gpu_run.sh python -m pytest -q tests/gpu      # run one command
#   . scripts/gpu_run.sh && python -m radixserve.bench_one_batch ...   # or source it
#
# Installs the wheels carried in .whl/ (see scripts/gpu_wheels.sh) into /tmp/site, puts
# /tmp/site and the checkout on PYTHONPATH, and keeps NVLink multicast off.
if [ -d .whl ] && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_run.sh: installing the carried wheels failed" >&2; return 1 2>/dev/null || exit 1; }
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PATH="/tmp/site/bin:$PATH"
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ "$#" -gt 0 ]; then
  exec "$@"
fi
