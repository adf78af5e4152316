#!/usr/bin/env bash
# radixserve and the peers (vLLM, SGLang) on one model, one server at a time, alternating engines
# round by round, the same client (ours, POST /v1/completions with token-id prompts, streamed, as
# ../shared/ANCHORS.md ran them) and the same workloads. On the H200 machine, from the repository
# root, with .whl and .qwen2-tokenizer carried and the peers unpacked where ../shared/peers/README.md
# puts them (/tmp/vllm, /tmp/sglang):
#
#   MODEL=benchmarks/configs/qwen3-8b bash scripts/gpu_peer_bench.sh     # results under $OUT
#
# Environment:
#   MODEL       a benchmark config dir (config.json; dummy weights); the peers get a copy of it with
#               the tokenizer files beside it
#   ENGINES     run in this order each round (default "radixserve vllm sglang"); a peer whose
#               bundle is not unpacked is skipped with a line
#   WORKLOADS   which of "random rate gsp agent" (default "random rate gsp")
#   REPEAT      rounds (default 1)
#   DEADLINE_S  the whole script's budget (default 560); an engine starts only with MIN_LEFT_S left
#   OURS_ARGS / VLLM_ARGS / SGLANG_ARGS   extra flags per engine (SGLang runs triton attention: its
#               bundle has no FA3 objects)
#   N_RANDOM IN_LEN OUT_LEN / N_RATE RATE: the random workloads' sizes (ANCHORS defaults)
# One JSON line per run in $OUT/ENGINE.jsonl (bench_serving's record: its settings name the workload).
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
. scripts/gpu_run.sh || exit 1
OUT=${OUT:-runs/peers}
mkdir -p "$OUT"
LOGS=${LOGS:-/tmp/peer-logs}  # server logs stay on the machine: few files come back from $OUT
mkdir -p "$LOGS"
MODEL=${MODEL:-benchmarks/configs/qwen2-7b}
ENGINES=${ENGINES:-radixserve vllm sglang}
WORKLOADS=${WORKLOADS:-random rate gsp}
REPEAT=${REPEAT:-1}
DEADLINE_S=${DEADLINE_S:-560}
MIN_LEFT_S=${MIN_LEFT_S:-150}
PORT=${PORT:-30000}
N_RANDOM=${N_RANDOM:-1000} IN_LEN=${IN_LEN:-1024} OUT_LEN=${OUT_LEN:-512}
N_RATE=${N_RATE:-300} RATE=${RATE:-5}
left() { echo $((DEADLINE_S - ($(date +%s) - T0))); }
log() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

# The peers read the tokenizer from the model dir.
PEER_MODEL=/tmp/peer-model-$(basename "$MODEL")
mkdir -p "$PEER_MODEL" && cp "$MODEL"/config.json .qwen2-tokenizer/* "$PEER_MODEL"/

. scripts/server_process.sh
PEER_PID=""
stop_peer() {
  if [ -n "$PEER_PID" ]; then
    kill -- "-$PEER_PID" 2>/dev/null || kill "$PEER_PID" 2>/dev/null
    for _ in $(seq 30); do kill -0 "$PEER_PID" 2>/dev/null || break; sleep 1; done
    kill -9 -- "-$PEER_PID" 2>/dev/null
    PEER_PID=""
    sleep 3  # the GPU memory comes back once the workers are gone
  fi
}
trap 'stop_peer; stop_server' EXIT
start_peer() {  # engine log: a peer in its own process group, its PYTHONPATH its own
  local engine=$1 logf=$2
  case $engine in
    vllm)
      [ -d /tmp/vllm ] || { log "vllm: /tmp/vllm missing"; return 1; }
      # shellcheck disable=SC2086
      setsid env PYTHONPATH=/tmp/vllm HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 python3 -m vllm.entrypoints.openai.api_server \
        --model "$PEER_MODEL" --load-format dummy --dtype bfloat16 --port "$PORT" --gpu-memory-utilization 0.85 \
        --enable-prefix-caching ${VLLM_ARGS:-} > "$logf" 2>&1 & ;;
    sglang)
      [ -d /tmp/sglang ] || { log "sglang: /tmp/sglang missing"; return 1; }
      # shellcheck disable=SC2086
      setsid env PYTHONPATH=/tmp/sglang python3 -m sglang.launch_server --model-path "$PEER_MODEL" \
        --load-format dummy --attention-backend triton --enable-cache-report --mem-fraction-static 0.85 --port "$PORT" \
        ${SGLANG_ARGS:-} \
        > "$logf" 2>&1 & ;;
  esac
  PEER_PID=$!
  for _ in $(seq 400); do
    kill -0 "$PEER_PID" 2>/dev/null || break
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then return 0; fi
    sleep 1
  done
  tail -30 "$logf"
  stop_peer
  return 1
}

bench() {  # engine round workload label, then bench_serving arguments
  local engine=$1 round=$2 workload=$3 label=$4; shift 4
  case " $WORKLOADS " in *" $workload "*) ;; *) return ;; esac
  local budget flush=()
  budget=$(left)
  if [ "$budget" -lt 20 ]; then log "skip $engine $label: ${budget}s left"; return; fi
  [ "$engine" = vllm ] || flush=(--flush-cache)
  log "run $engine $label round $round (at most ${budget}s)"
  timeout -k 5 "$budget" python3 -m radixserve.bench_serving --backend openai --port "$PORT" \
    --tokenizer .qwen2-tokenizer --model "$PEER_MODEL" "${flush[@]}" --disable-tqdm \
    --output-file "$OUT/$engine.jsonl" "$@" | grep -E "throughput|TTFT|TPOT|hit rate|Successful" \
    || log "$engine $label: exit $?"
}

for round in $(seq "$REPEAT"); do
  for engine in $ENGINES; do
    if [ "$(left)" -lt "$MIN_LEFT_S" ]; then log "skip $engine round $round: $(left)s left"; continue; fi
    log "start $engine"
    if [ "$engine" = radixserve ]; then
      # shellcheck disable=SC2086
      start_server "$LOGS/radixserve-$round" --model-path "$MODEL" --load-format dummy --tokenizer-path .qwen2-tokenizer \
        --served-model-name "$PEER_MODEL" ${OURS_ARGS:-} || { log "radixserve did not come up"; continue; }
    else
      start_peer "$engine" "$LOGS/$engine-$round.log" || { log "$engine did not come up"; continue; }
    fi
    log "$engine up"
    bench "$engine" "$round" random "random ${IN_LEN}/${OUT_LEN} x${N_RANDOM}" --dataset-name random-ids \
      --num-prompts "$N_RANDOM" --random-input-len "$IN_LEN" --random-output-len "$OUT_LEN" --request-rate inf
    bench "$engine" "$round" rate "random rate $RATE x${N_RATE}" --dataset-name random-ids --num-prompts "$N_RATE" \
      --random-input-len "$IN_LEN" --random-output-len "$OUT_LEN" --request-rate "$RATE"
    bench "$engine" "$round" gsp "gsp 64x16" --dataset-name generated-shared-prefix --prompt-ids --gsp-num-groups 64 \
      --gsp-prompts-per-group 16 --gsp-system-prompt-len 2048 --gsp-question-len 128 --gsp-output-len 256 \
      --request-rate inf
    bench "$engine" "$round" agent "agent 256x5" --dataset-name agent --agent-num-sessions 256 --agent-turns 5 \
      --agent-num-system-prompts 8 --agent-system-prompt-len 2048 --agent-user-len 256 --agent-assistant-len 128 \
      --agent-output-len 128 --num-prompts 1280 --request-rate inf
    if [ "$engine" = radixserve ]; then stop_server; else stop_peer; fi
  done
done
log "done"
