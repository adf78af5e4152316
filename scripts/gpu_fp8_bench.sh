#!/usr/bin/env bash
# The FP8 rows on one H200, from the repository root (with .whl and .qwen2-tokenizer carried), one
# part per call (each fits a 10-minute command):
#
#   PART=decode   bash scripts/gpu_fp8_bench.sh   # decode step at batch 1/16/64/256 against the FP8 floor
#   PART=serving  bash scripts/gpu_fp8_bench.sh   # the ANCHORS workloads on dummy FP8 weights
#   PART=burst    bash scripts/gpu_fp8_bench.sh   # the random burst (1,000 x 1,024/512, all at once) on
#                                                 # bf16, FP8 weights, FP8 weights + FP8 KV, alternated
#   PART=pressure bash scripts/gpu_fp8_bench.sh   # gsp: a 150k-token bf16 KV pool, then an FP8 pool of
#                                                 # the same bytes (300k tokens)
#   PART=sweep    bash scripts/gpu_fp8_bench.sh   # the projections alone: FP8 decode-row GEMM tiles and
#                                                 # torch._scaled_mm against bf16 at M 64/16/1/256, and
#                                                 # where an 8,192-token FP8 prefill's projection time goes
#
# decode: bench_one_batch with --quantization fp8 (its floors count one byte per projection weight),
# bf16 rows beside it for the ratio; serving: scripts/gpu_serving_bench.sh with
# SERVER_ARGS="--quantization fp8" (compare with its bf16 rows); burst: scripts/gpu_agent_bench.sh
# with the random workload, one fresh server per configuration (CONFIGS and REPEAT as there, the
# pool large enough for every request at once); pressure: scripts/gpu_agent_bench.sh
# with WORKLOAD=gsp and two configurations; sweep: scripts/decode_linear_sweep.py --fp8-prefill --fp8
# (about 6 minutes: its config grids stop after GRID_BUDGET_S seconds, default 270). Results under $OUT
# (else runs/fp8).
# Environment: MODEL (default the Qwen2-7B config), OUT, PART, BF16_POOL (default 150000 tokens),
# GRID_BUDGET_S, CONFIGS (burst, pressure), REPEAT (burst).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/fp8}
MODEL=${MODEL:-benchmarks/configs/qwen2-7b}
BF16_POOL=${BF16_POOL:-150000}
PART=${PART:-decode}
mkdir -p "$OUT"
case "$PART" in
  decode)
    . scripts/gpu_run.sh || exit 1
    for kv in auto fp8_e4m3; do
      python3 -m radixserve.bench_one_batch --model-path "$MODEL" --load-format dummy --skip-attention \
        --batch-sizes 1 16 64 256 --contexts 1024 --quantization fp8 --kv-cache-dtype "$kv" \
        --json "$OUT/one_batch_fp8_kv_$kv.json"
    done
    python3 -m radixserve.bench_one_batch --model-path "$MODEL" --load-format dummy --skip-attention \
      --batch-sizes 1 16 64 256 --contexts 1024 --json "$OUT/one_batch_bf16.json"
    ;;
  serving)
    OUT="$OUT/serving" MODELS="$MODEL" SERVER_ARGS="--quantization fp8 ${SERVER_ARGS:-}" \
      bash scripts/gpu_serving_bench.sh
    ;;
  burst)
    OUT="$OUT/burst" MODEL="$MODEL" BACKEND=openai POOL=1600000 REPEAT="${REPEAT:-1}" \
      CLIENT_ARGS="--dataset-name random-ids --num-prompts 1000 --random-input-len 1024 --random-output-len 512 --request-rate inf" \
      CONFIGS="${CONFIGS:-bf16:--schedule-policy,lpm fp8:--quantization,fp8 fp8-kv:--quantization,fp8,--kv-cache-dtype,fp8_e4m3}" \
      bash scripts/gpu_agent_bench.sh
    ;;
  pressure)
    OUT="$OUT/pressure" MODEL="$MODEL" WORKLOAD=gsp POOL="$BF16_POOL" \
      CONFIGS="${CONFIGS:-bf16-kv:--schedule-policy,lpm fp8-kv:--schedule-policy,lpm,--kv-cache-dtype,fp8_e4m3,--max-total-tokens,$((2 * BF16_POOL))}" \
      bash scripts/gpu_agent_bench.sh
    ;;
  sweep)
    . scripts/gpu_run.sh || exit 1
    python3 scripts/decode_linear_sweep.py --models "$MODEL" --fp8-prefill --fp8 --rows 64 16 1 256 \
      --grid-budget-s "${GRID_BUDGET_S:-270}" --json "$OUT/fp8_linear_sweep.json" 2>&1 | tee "$OUT/fp8_linear_sweep.txt"
    ;;
  *) echo "PART must be decode, serving, burst, pressure or sweep" >&2; exit 2 ;;
esac
