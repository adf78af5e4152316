#!/usr/bin/env bash
# Start-up memory sizing under bursts: one fresh server per configuration with no
# --max-total-tokens (the pool sized from --mem-fraction-static and the measured working set),
# then bursts against it; after each configuration its memory line, allocation failures, the
# allocator's peaks and whether the engine survived. On the H200 machine, from the repository
# root, with .whl and .qwen2-tokenizer carried:
#
#   CONFIGS="bf16-085:--mem-fraction-static,0.85 fp8-090:--quantization,fp8,--kv-cache-dtype,fp8_e4m3,--mem-fraction-static,0.90" \
#     WORKLOADS="random gsp" bash scripts/gpu_memory_bench.sh
#
# MIN_LEFT_S: a configuration starts only with this much of DEADLINE_S left (default 90).
# WORKLOADS: any of "random gsp agent" (random: 1,000 x 1,024/512 at once; gsp: 64 x 16 over
# 2,048-token system prompts; agent: 256 sessions x 5 turns, as scripts/gpu_agent_bench.sh).
# A label's flags are joined by commas; environment variables (PYTORCH_CUDA_ALLOC_CONF) go in
# front of the script and hold for every configuration.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_run.sh || exit 1
OUT=${OUT:-runs/memory}
MODEL=${MODEL:-benchmarks/configs/qwen2-7b}
TOKENIZER=${TOKENIZER-.qwen2-tokenizer}
PORT=${PORT:-30000}
WORKLOADS=${WORKLOADS:-random gsp}
CONFIGS=${CONFIGS:-"bf16-085:--mem-fraction-static,0.85"}
DEADLINE_S=${DEADLINE_S:-540}
T0=$(date +%s)
left() { echo $((DEADLINE_S - ($(date +%s) - T0))); }
mkdir -p "$OUT"
. scripts/server_process.sh
trap stop_server EXIT
bench() {
  local label=$1; shift
  timeout -k 5 "$(left)" python3 -m radixserve.bench_serving --backend openai --port "$PORT" --tokenizer "$TOKENIZER" \
    --flush-cache --disable-tqdm --output-file "$OUT/results.jsonl" "$@" > "$OUT/bench-$label.txt" 2>&1
  echo "$label: exit $? $(grep -E 'Successful requests|Failed requests|Output token throughput' "$OUT/bench-$label.txt" | tr -s ' ' | tr '\n' ';')"
}
for entry in $CONFIGS; do
  label=${entry%%:*}; flags=${entry#*:}
  [ "$(left)" -lt "${MIN_LEFT_S:-90}" ] && { echo "skip $label: $(left)s left"; continue; }
  # shellcheck disable=SC2046
  if ! start_server "$OUT/server-$label" --model-path "$MODEL" --load-format dummy --tokenizer-path "$TOKENIZER" \
      $(tr ',' ' ' <<< "$flags"); then echo "$label: server did not come up"; continue; fi
  for w in $WORKLOADS; do
    case $w in
      random) bench "$label-random" --dataset-name random-ids --num-prompts 1000 --random-input-len 1024 \
                --random-output-len 512 --request-rate inf ;;
      gsp) bench "$label-gsp" --dataset-name generated-shared-prefix --prompt-ids --gsp-num-groups 64 \
             --gsp-prompts-per-group 16 --gsp-system-prompt-len 2048 --gsp-question-len 128 --gsp-output-len 256 \
             --request-rate inf ;;
      agent) bench "$label-agent" --dataset-name agent --agent-num-sessions 256 --agent-turns 5 \
               --agent-num-system-prompts 8 --agent-system-prompt-len 2048 --agent-user-len 256 \
               --agent-assistant-len 128 --agent-output-len 128 --num-prompts 1280 --request-rate inf --seed 1 ;;
    esac
  done
  curl -s "http://127.0.0.1:$PORT/server_info" | python3 -c 'import json,sys; d=json.load(sys.stdin); s=d.get("stats") or {}
print("alive", d["engine_alive"], "pool", d["pool_size"], "alloc_failures", s.get("alloc_failures"),
      "peak reserved GiB %.2f allocated %.2f" % (s.get("device_peak_reserved_bytes", 0) / 2**30, s.get("device_peak_allocated_bytes", 0) / 2**30))'
  grep -h "memory:\|could not allocate\|OutOfMemory\|Traceback" "$OUT/server-$label.log" | cut -c1-400 | head -8
  stop_server
done
