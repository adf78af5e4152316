#!/usr/bin/env bash
# The host tier (--hicache-ratio) on one GPU, each row beside the same run without the tier; the
# same client, seed and model as scripts/gpu_agent_bench.sh (which runs the servers). On the H200
# machine, from the repository root, with .whl and .qwen2-tokenizer carried:
#
#   bash scripts/gpu_hicache_bench.sh agent       # agent workload, 216,825-token pool, host tier 4x
#   bash scripts/gpu_hicache_bench.sh gsp         # gsp 64x16, 150k-token pool, 1.2M-token host tier
#   bash scripts/gpu_hicache_bench.sh bandwidth   # host-to-device load vs a plain pinned copy
#
# CONFIGS, REPEAT, DEADLINE_S and OUT pass through to gpu_agent_bench.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-agent}" in
  agent)
    POOL=216825 WORKLOAD=agent OUT=${OUT:-runs/hicache-agent} \
      CONFIGS=${CONFIGS:-"lpm:--schedule-policy,lpm lpm-hicache:--schedule-policy,lpm,--hicache-ratio,4"} \
      exec bash scripts/gpu_agent_bench.sh ;;
  gsp)
    POOL=150000 WORKLOAD=gsp OUT=${OUT:-runs/hicache-gsp} \
      CONFIGS=${CONFIGS:-"lpm:--schedule-policy,lpm lpm-hicache:--schedule-policy,lpm,--hicache-ratio,8"} \
      exec bash scripts/gpu_agent_bench.sh ;;
  bandwidth)
    set --  # gpu_run.sh runs its arguments as a command: source it with none
    . scripts/gpu_run.sh || exit 1
    mkdir -p "${OUT:-runs/hicache-bandwidth}"
    exec python3 scripts/hicache_bandwidth.py --json "${OUT:-runs/hicache-bandwidth}/bandwidth.json" ;;
  *) echo "usage: $0 agent|gsp|bandwidth" >&2; exit 2 ;;
esac
