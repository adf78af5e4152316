#!/usr/bin/env bash
# Router policies compared on 2 GPUs: two workers (one per GPU, KV pool capped), and for each of
# round_robin, cache_aware and kv_aware a router over both, the workers' caches flushed, and
# bench_serving's `agent` workload sent through the router. On the 2 x H200 machine, from the
# repository root, with .whl and .qwen2-tokenizer carried:
#
#   bash scripts/gpu_router_bench.sh     # results under $OUT (else runs/router)
#
# Expected 4-5 minutes (two start-ups in parallel, ~40 s; each policy ~1 min with the client's
# dataset build); never more than DEADLINE_S (360 s) plus the shutdown of the processes.
#
# Writes $OUT/results.jsonl (bench_serving's record per policy), $OUT/policies.jsonl (one line per
# policy: aggregated hit rate, throughput, TTFT, P99, failures, requests per worker, routing
# decisions), $OUT/summary.md (the table), and each process's log.
#
# The workload: SESSIONS agent conversations of TURNS turns over SYS_PROMPTS system prompts of
# SYS_LEN tokens; each turn adds USER_LEN tokens (a user message / tool result) and, in the
# history, ASSIST_LEN tokens of fixed reply; OUT_LEN tokens generated per turn (greedy,
# ignore_eos). Every session starts at once (--request-rate inf) and waits THINK_S (mean,
# exponential) between turns. The defaults hold ~650k distinct tokens (prompts + outputs): a
# worker that keeps its own sessions needs ~300k of them, so with POOL=350000 per worker the
# workload fits across the two workers when each conversation stays on one, but not on one
# worker; round_robin scatters each conversation over both, so a turn often lands where the
# previous turns are not and recomputes its history (the LRU oracle of radixserve/bench/oracle.py,
# run on this workload with these pools: round_robin ~0.78, session-sticky ~0.87, one worker with
# one pool ~0.72).
#
# Environment (defaults = the H200 run):
#   MODEL        model dir (dummy weights); "tiny" = the built-in tiny model (CPU dry run)
#   TOKENIZER    --tokenizer-path for workers, routers and the client ("" = the model's own)
#   DEVICE       cuda | cpu;  GPUS: CUDA_VISIBLE_DEVICES of worker 0 and worker 1 ("0 1")
#   POLICIES     "round_robin balanced cache_aware kv_aware"
#   POOL         --max-total-tokens of each worker (350000)
#   SESSIONS TURNS SYS_PROMPTS SYS_LEN USER_LEN ASSIST_LEN OUT_LEN THINK_S RATE: workload sizes
#   WORKER_ARGS  extra launch_server flags for both workers
#   ROUTER_ARGS  extra launch_router flags (e.g. "--balance-abs-threshold 8 --balance-rel-threshold 1.2")
#   DEADLINE_S   the whole script's budget (360): each policy's run is cut at an equal share of what
#                is left (at least MIN_POLICY_S=30; policies without that much left are skipped)
#   START_TIMEOUT_S  how long the workers may take to answer /health (240)
#   SKIP_WHEELS=1    the current python as it is (a CPU dry run, no .whl)
#
# CPU dry run (the built-in tiny model, ~25 s on 2 cores):
#   SKIP_WHEELS=1 MODEL=tiny DEVICE=cpu TOKENIZER= POOL=4096 SESSIONS=12 TURNS=3 SYS_PROMPTS=2 \
#     SYS_LEN=160 USER_LEN=24 ASSIST_LEN=24 OUT_LEN=8 THINK_S=0.05 OUT=/tmp/router-dry bash scripts/gpu_router_bench.sh
# The same with the real tokenizer: MODEL=<dir with a config.json of a 2-layer, 64-wide qwen2 with
# vocab_size 152064> TOKENIZER=.qwen2-tokenizer POOL=20000 SYS_LEN=512 USER_LEN=64 ASSIST_LEN=32 (~45 s).
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
if [ -z "${SKIP_WHEELS:-}" ]; then
  . scripts/gpu_run.sh || exit 1
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-runs/router}
mkdir -p "$OUT"
MODEL=${MODEL:-benchmarks/configs/qwen2-7b}
TOKENIZER=${TOKENIZER-.qwen2-tokenizer}
DEVICE=${DEVICE:-cuda}
GPUS=${GPUS:-0 1}
POLICIES=${POLICIES:-round_robin balanced cache_aware kv_aware}
POOL=${POOL:-350000}
SESSIONS=${SESSIONS:-256} TURNS=${TURNS:-5} SYS_PROMPTS=${SYS_PROMPTS:-8} SYS_LEN=${SYS_LEN:-2048}
USER_LEN=${USER_LEN:-256} ASSIST_LEN=${ASSIST_LEN:-128} OUT_LEN=${OUT_LEN:-128} THINK_S=${THINK_S:-0.5}
RATE=${RATE:-inf}
WORKER_ARGS=${WORKER_ARGS:-}
ROUTER_ARGS=${ROUTER_ARGS:-}
DEADLINE_S=${DEADLINE_S:-360}
START_TIMEOUT_S=${START_TIMEOUT_S:-240}
RESERVE_S=${RESERVE_S:-20}   # kept back for the summary and the shutdown
MIN_POLICY_S=${MIN_POLICY_S:-30}
ROUTER_PORT=${ROUTER_PORT:-31000}
WORKER_PORTS=${WORKER_PORTS:-31001 31002}
RESULTS=$OUT/results.jsonl
POLICY_LINES=$OUT/policies.jsonl
: > "$RESULTS"; : > "$POLICY_LINES"
left() { echo $((DEADLINE_S - ($(date +%s) - T0))); }
log() { echo "[$(( $(date +%s) - T0 ))s] $*"; }

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'devices', torch.cuda.device_count())"

read -r -a GPU_LIST <<< "$GPUS"
read -r -a PORT_LIST <<< "$WORKER_PORTS"
WORKER_PIDS=()
ROUTER_PID=""
BENCH_PID=""
URLS=()

stop_pid() {  # pid: SIGTERM, up to 30 s, then SIGKILL
  local pid=$1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 0
  kill "$pid" 2>/dev/null
  for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.5; done
  kill -9 "$pid" 2>/dev/null
}
stop_router() { stop_pid "$ROUTER_PID"; ROUTER_PID=""; }
cleanup() {
  stop_pid "$BENCH_PID"
  stop_router
  for pid in "${WORKER_PIDS[@]}"; do kill "$pid" 2>/dev/null; done
  for pid in "${WORKER_PIDS[@]}"; do stop_pid "$pid"; done
  WORKER_PIDS=()
}
trap cleanup EXIT
trap 'log "interrupted"; exit 130' INT TERM

wait_health() {  # url pid timeout_s -> 0 when /health answers 200
  local url=$1 pid=$2 limit=$3 t
  t=$(date +%s)
  while [ $(( $(date +%s) - t )) -lt "$limit" ]; do
    kill -0 "$pid" 2>/dev/null || return 1
    curl -sf -m 5 "$url/health" >/dev/null && return 0
    sleep 1
  done
  return 1
}

flush_workers() {  # POST /flush_cache to each worker, retrying while requests still run (409)
  local url ok
  for url in "${URLS[@]}"; do
    ok=0
    for _ in $(seq 120); do
      if [ "$(curl -s -m 30 -o /dev/null -w '%{http_code}' -X POST "$url/flush_cache")" = 200 ]; then ok=1; break; fi
      sleep 0.5
    done
    [ "$ok" = 1 ] || { log "cannot flush $url"; return 1; }
  done
}

# ------------------------------------------------------------------ workers, started together
model_args=()
[ "$MODEL" != tiny ] && model_args+=(--model-path "$MODEL" --load-format dummy)
[ -n "$TOKENIZER" ] && model_args+=(--tokenizer-path "$TOKENIZER")
for i in 0 1; do
  port=${PORT_LIST[$i]}
  URLS+=("http://127.0.0.1:$port")
  env_args=(CUDA_VISIBLE_DEVICES="${GPU_LIST[$i]}")
  [ "$DEVICE" = cpu ] && env_args+=(OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MKL_NUM_THREADS="${OMP_NUM_THREADS:-1}")
  log "start worker $i on ${DEVICE} ${GPU_LIST[$i]}: port $port, --max-total-tokens $POOL"
  # shellcheck disable=SC2086
  env "${env_args[@]}" python3 -m radixserve.launch_server "${model_args[@]}" --device "$DEVICE" \
    --max-total-tokens "$POOL" --schedule-policy lpm --radix-eviction-policy lru $WORKER_ARGS \
    --host 127.0.0.1 --port "$port" --log-file "$OUT/worker-$i.log" > "$OUT/worker-$i.out" 2>&1 &
  WORKER_PIDS+=($!)
done
for i in 0 1; do
  if ! wait_health "${URLS[$i]}" "${WORKER_PIDS[$i]}" "$START_TIMEOUT_S"; then
    log "worker $i did not come up"; tail -30 "$OUT/worker-$i.out"; exit 1
  fi
done
log "workers up: ${URLS[*]}"
for i in 0 1; do
  curl -s -m 30 "${URLS[$i]}/server_info" | python3 -c "import json,sys; d=json.load(sys.stdin); print(f'worker $i: pool {d[\"pool_size\"]} tokens, device {d[\"device\"]}, dtype {d[\"dtype\"]}, max running {d[\"max_running_requests\"]}')"
done

# ------------------------------------------------------------------ one router per policy
read -r -a POLICY_LIST <<< "$POLICIES"
n_left=${#POLICY_LIST[@]}
for policy in "${POLICY_LIST[@]}"; do
  # an equal share of what is left (time a run does not use goes to the next), at least MIN_POLICY_S;
  # with less than that left, the remaining policies are skipped (POLICIES is in priority order)
  avail=$(( $(left) - RESERVE_S ))
  budget=$(( avail / n_left ))
  n_left=$((n_left - 1))
  [ "$budget" -lt "$MIN_POLICY_S" ] && budget=$MIN_POLICY_S
  if [ "$avail" -lt "$budget" ]; then log "skip $policy: ${avail}s left"; continue; fi
  log "$policy: flush the workers, start the router (run cut at ${budget}s)"
  flush_workers || continue
  router_args=(--worker-urls "${URLS[@]}" --policy "$policy" --host 127.0.0.1 --port "$ROUTER_PORT" --log-level warning)
  [ -n "$TOKENIZER" ] && router_args+=(--tokenizer-path "$TOKENIZER")
  router_args+=($ROUTER_ARGS)
  python3 -m radixserve.launch_router "${router_args[@]}" > "$OUT/router-$policy.out" 2>&1 &
  ROUTER_PID=$!
  router_url="http://127.0.0.1:$ROUTER_PORT"
  if ! wait_health "$router_url" "$ROUTER_PID" 60; then
    log "$policy: the router did not come up"; tail -20 "$OUT/router-$policy.out"; stop_router; continue
  fi
  t_run=$(date +%s)
  n_before=$(wc -l < "$RESULTS")
  timeout -k 5 "$budget" python3 -m radixserve.bench_serving --base-url "$router_url" --backend openai \
    ${TOKENIZER:+--tokenizer "$TOKENIZER"} --dataset-name agent --num-prompts $((SESSIONS * TURNS)) \
    --agent-num-sessions "$SESSIONS" --agent-turns "$TURNS" --agent-num-system-prompts "$SYS_PROMPTS" \
    --agent-system-prompt-len "$SYS_LEN" --agent-user-len "$USER_LEN" --agent-assistant-len "$ASSIST_LEN" \
    --agent-output-len "$OUT_LEN" --agent-think-time "$THINK_S" --request-rate "$RATE" --seed 1 \
    --flush-cache --request-timeout "$budget" --disable-tqdm \
    --metrics-url "${URLS[0]}" --metrics-url "${URLS[1]}" --output-file "$RESULTS" > "$OUT/bench-$policy.out" 2>&1 &
  BENCH_PID=$!  # in the background, so a signal to this script is handled at once
  wait "$BENCH_PID"
  code=$?
  BENCH_PID=""
  grep -E "Successful|Failed requests|duration|Output token|Total token|Median TTFT|P99 TTFT|P99 E2E|Hit rate" \
    "$OUT/bench-$policy.out" | sed "s/^/  $policy: /"
  [ "$code" = 0 ] || { log "$policy: bench_serving exit $code"; tail -5 "$OUT/bench-$policy.out"; }
  curl -s -m 10 "$router_url/workers" > "$OUT/router-$policy-workers.json"
  curl -s -m 10 "$router_url/metrics" > "$OUT/router-$policy-metrics.txt"
  # bench_serving appends its record when the run ends: a run cut at its time share appends none
  python3 - "$policy" "$RESULTS" "$OUT" "$code" "$(( $(date +%s) - t_run ))" "$POOL" "$n_before" \
    >> "$POLICY_LINES" <<'PY'
import json, sys
policy, results, out, code, wall, pool, n_before = sys.argv[1:8]
lines = open(results).read().splitlines()
rec = json.loads(lines[int(n_before)]) if len(lines) > int(n_before) else None
try:
    workers = json.load(open(f"{out}/router-{policy}-workers.json"))["workers"]
except Exception:
    workers = []
decisions = {}
try:
    for line in open(f"{out}/router-{policy}-metrics.txt"):
        if line.startswith("radixserve:router_routing_decisions_total{"):
            d = line.split('decision="', 1)[1].split('"', 1)[0]
            decisions[d] = decisions.get(d, 0) + int(float(line.rsplit(" ", 1)[1]))
except OSError:
    pass
row = {"policy": policy, "exit_code": int(code), "wall_s": int(wall), "pool_per_worker": int(pool),
       "requests_per_worker": {w["url"]: w["requests"] for w in workers}, "decisions": decisions}
if rec is not None:
    row.update({k: rec.get(k) for k in ("completed", "failed", "failure_reasons", "duration_s", "hit_rate",
                                        "metrics_hit_rate", "hit_rate_matches_metrics", "oracle_hit_rate",
                                        "oracle_hit_rate_capacity", "oracle_capacity_tokens",
                                        "request_throughput", "output_throughput", "total_throughput",
                                        "total_input_tokens", "total_output_tokens")})
    row.update(ttft_p50_ms=rec["ttft_ms"]["median"], ttft_p99_ms=rec["ttft_ms"]["p99"],
               e2e_p50_ms=rec["e2e_latency_ms"]["median"], e2e_p99_ms=rec["e2e_latency_ms"]["p99"],
               tpot_mean_ms=rec["tpot_ms"]["mean"], dataset=rec.get("dataset"))
else:
    row["error"] = f"no record (exit {code}): the run failed or was cut at its time share; see bench-{policy}.out"
print(json.dumps(row))
PY
  stop_router
  log "$policy: done"
done
cleanup

log "summary"
python3 - "$POLICY_LINES" "$OUT" <<'PY' | tee "$OUT/summary.md"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
first = next((r for r in rows if "dataset" in r), None)
if first:
    d = first["dataset"]
    print(f"Workload: agent, {d['sessions']} sessions, {d['num_requests']} requests, {d['prompt_tokens']:,} prompt "
          f"tokens, system-prompt share {d['system_prompt_fraction']}; KV pool {first['pool_per_worker']:,} tokens "
          f"per worker; oracle hit rate (one unlimited cache) {first['oracle_hit_rate']:.3f}, (one cache of both "
          f"pools, LRU) {first['oracle_hit_rate_capacity']:.3f}.\n")
print("| policy | ok/failed | duration s | hit rate (responses / workers' /metrics) | output tok/s | total tok/s "
      "| req/s | TTFT p50 / p99 ms | E2E p99 s | requests per worker | routing decisions |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
f = lambda v, d=3: "n/a" if v is None else f"{v:,.{d}f}"
for r in rows:
    spread = "/".join(str(n) for n in r["requests_per_worker"].values()) or "-"
    dec = ", ".join(f"{k} {v}" for k, v in sorted(r["decisions"].items())) or "-"
    if "error" in r:
        print(f"| {r['policy']} | - | - | - | - | - | - | - | - | {spread} | {dec}: {r['error']} |")
        continue
    print(f"| {r['policy']} | {r['completed']}/{r['failed']} | {r['duration_s']:.1f} | {f(r['hit_rate'])} / "
          f"{f(r['metrics_hit_rate'])} | {f(r['output_throughput'], 0)} | {f(r['total_throughput'], 0)} | "
          f"{f(r['request_throughput'], 2)} | {f(r['ttft_p50_ms'], 0)} / {f(r['ttft_p99_ms'], 0)} | "
          f"{f(r['e2e_p99_ms'] / 1000, 2)} | {spread} | {dec} |")
    if r["failed"]:
        print(f"|   | failures: {r['failure_reasons']} |")
PY
log "done"
