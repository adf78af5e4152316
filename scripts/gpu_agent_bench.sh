#!/usr/bin/env bash
# The seed's scenario on one GPU: the agent workload (256 sessions x 5 turns over 8 system prompts
# of 2,048 tokens, all sessions at once) against a KV pool too small to keep every conversation,
# one fresh server per configuration, the same client and seed for each. On the H200 machine,
# from the repository root, with .whl and .qwen2-tokenizer carried:
#
#   bash scripts/gpu_agent_bench.sh                 # results under $OUT (else runs/agent)
#
# Environment:
#   CONFIGS     space-separated "label:server flags" entries, flags joined by commas
#               (default: lpm, fcfs, lpm with the prefix hold off: --prefix-hold-s 0)
#   MODEL       model dir (dummy weights; default the Qwen2-7B config)
#   POOL        --max-total-tokens (default 216825, as the ANCHORS runs; auto: none, the memory
#               plan sizes the pool from --mem-fraction-static)
#   WORKLOAD    agent (default) or gsp (64 groups x 16, 2,048-token system prompts, 1,024 at once)
#   CLIENT_ARGS bench_serving workload flags replacing the above (a quick CPU check of the script)
#   REPEAT      how many times the list of configurations is run, alternating (default 1)
#   DEADLINE_S  the whole script's budget (default 540)
#   MIN_LEFT_S  a configuration starts only with this much of the budget left (default 120)
#   MONITOR     1: record GPU clocks and the busiest host threads every second of each run
#               (monitor-LABEL-ROUND.txt; see scripts/server_process.sh)
#   PROFILE     1: sample the engine process's Python stacks during each run with py-spy (when it is
#               installed: carry its wheel in .whl) into pyspy-LABEL-ROUND.txt (collapsed stacks)
#   TRACE       1: the engine's step trace (--step-trace-file) into steps-LABEL-ROUND.csv, its
#               summary printed after each run (a step's wait for the device against its host work)
#   (a configuration with --log-requests among its flags gets its slowest 1% listed after its run:
#   arrival, prompt and cached tokens, TTFT; radixserve.bench.request_log)
#   PIN         "ENGINE API CLIENT" cpu lists (taskset -c form): every thread of the engine, of the API
#               process and the client kept on those CPUs, for repeats at one core's speed
#               (scripts/cpu_pairs_probe.py measures each CPU's speed, alone and beside another)
#   BACKEND     the client's endpoint: sglang (default, /generate: every event carries the whole
#               output so far, as the anchors ran) or openai (/v1/completions, deltas: less work
#               for the host per streamed token, for repeats that should measure the engine)
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
if [ -z "${SKIP_WHEELS:-}" ]; then . scripts/gpu_run.sh || exit 1; else export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"; fi
OUT=${OUT:-runs/agent}
mkdir -p "$OUT"
MODEL=${MODEL:-benchmarks/configs/qwen2-7b}
TOKENIZER=${TOKENIZER-.qwen2-tokenizer}
POOL=${POOL:-216825}
WORKLOAD=${WORKLOAD:-agent}
REPEAT=${REPEAT:-1}
CONFIGS=${CONFIGS:-"lpm:--schedule-policy,lpm fcfs:--schedule-policy,fcfs lpm-nohold:--schedule-policy,lpm,--prefix-hold-s,0"}
DEADLINE_S=${DEADLINE_S:-540}
MIN_LEFT_S=${MIN_LEFT_S:-120}
BACKEND=${BACKEND:-sglang}
PORT=${PORT:-30000}
RESULTS=$OUT/results.jsonl
left() { echo $((DEADLINE_S - ($(date +%s) - T0))); }
log() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
if [ -n "${CLIENT_ARGS:-}" ]; then
  read -r -a CLIENT <<< "$CLIENT_ARGS"
elif [ "$WORKLOAD" = gsp ]; then
  CLIENT=(--dataset-name generated-shared-prefix --prompt-ids --gsp-num-groups 64 --gsp-prompts-per-group 16
          --gsp-system-prompt-len 2048 --gsp-question-len 128 --gsp-output-len 256 --request-rate inf)
else
  CLIENT=(--dataset-name agent --agent-num-sessions 256 --agent-turns 5 --agent-num-system-prompts 8
          --agent-system-prompt-len 2048 --agent-user-len 256 --agent-assistant-len 128 --agent-output-len 128
          --num-prompts 1280 --request-rate inf)
fi
. scripts/server_process.sh
pool_flag=(--max-total-tokens "$POOL")
if [ "$POOL" = auto ]; then pool_flag=(); fi
for round in $(seq "$REPEAT"); do
  for entry in $CONFIGS; do
    label=${entry%%:*}; flags=${entry#*:}; IFS=, read -r -a extra <<< "$flags"
    if [ "$(left)" -lt "$MIN_LEFT_S" ]; then log "skip $label: $(left)s left"; continue; fi
    log "start $label (round $round): ${extra[*]}"
    trace=()
    if [ -n "${TRACE:-}" ]; then trace=(--step-trace-file "$OUT/steps-$label-$round.csv"); fi
    if ! start_server "$OUT/server-$label-$round" --model-path "$MODEL" --load-format dummy \
        ${TOKENIZER:+--tokenizer-path "$TOKENIZER"} "${pool_flag[@]}" --radix-eviction-policy lru \
        "${trace[@]}" "${extra[@]}"; then
      log "$label did not come up"; continue
    fi
    client_pin=()
    if [ -n "${PIN:-}" ]; then
      read -r pin_engine pin_api pin_client <<< "$PIN"
      for pid in $(pgrep -f radixserve.engine.engine_process); do taskset -apc "$pin_engine" "$pid" > /dev/null; done
      taskset -apc "$pin_api" "$SERVER_PID" > /dev/null
      client_pin=(taskset -c "$pin_client")
    fi
    log "run $label"
    if [ -n "${MONITOR:-}" ]; then start_monitor "$OUT/monitor-$label-$round.txt"; fi
    if [ -n "${PROFILE:-}" ] && command -v py-spy >/dev/null; then
      py-spy record --nonblocking --rate 250 --format raw --duration "${PROFILE_S:-25}" \
        --pid "$(pgrep -f radixserve.engine.engine_process | head -1)" -o "$OUT/pyspy-$label-$round.txt" \
        > "$OUT/pyspy-$label-$round.log" 2>&1 &
    fi
    timeout -k 5 "$(left)" "${client_pin[@]}" python3 -m radixserve.bench_serving --backend "$BACKEND" --port "$PORT" \
      ${TOKENIZER:+--tokenizer "$TOKENIZER"} --seed 1 --disable-tqdm --output-file "$RESULTS" \
      "${CLIENT[@]}" | grep -iE "hit|throughput|latency|TTFT|Belady|LRU|oracle|Successful|Failed" \
      || log "$label: client exit $?"
    stop_monitor
    # What the scheduler did for conversations (the prefix hold's counters), before the server goes.
    curl -s "http://127.0.0.1:$PORT/metrics" | grep -E "^radixserve:(continued_turns|prefix_holds|state_snapshot[a-z_]*)(_total)? " \
      | sed "s/^/[$label] /"
    curl -s "http://127.0.0.1:$PORT/server_info" > "$OUT/server_info-$label-$round.json"  # the memory plan
    stop_server
    if [ -n "${TRACE:-}" ]; then python3 -m radixserve.engine.step_trace "$OUT/steps-$label-$round.csv" | sed "s/^/[$label] /"; fi
    # With --log-requests among the flags: who the slowest 1% were.
    case " ${extra[*]} " in *" --log-requests "*)
      python3 -m radixserve.bench.request_log "$OUT/server-$label-$round.log" | sed "s/^/[$label] /" ;; esac
  done
done
log "done"
