#!/usr/bin/env bash
# The three workloads of ../shared/ANCHORS.md through our server (POST /v1/completions, token-id
# prompts, stream, include_usage, temperature 0, ignore_eos), one server per model, each run from
# an empty cache. On the H200 machine, from the repository root, with .whl and .qwen2-tokenizer
# carried:
#
#   bash scripts/gpu_serving_bench.sh            # results under $OUT (else runs/serving)
#
# .qwen2-tokenizer: the real Qwen2 vocabulary (151,643 regular + 22 special tokens) built by
# scripts/qwen2_tokenizer.py from the `dashscope` package's qwen.tiktoken; the benchmark configs
# carry no tokenizer, and without one the server streams no text, so TTFT could not be timed.
#
# Environment (defaults = the ANCHORS workloads):
#   MODELS      model dirs, run in order (dummy weights); "tiny" = the built-in tiny model (CPU test)
#   TOKENIZER   --tokenizer-path for the server and the client ("" = the model's own)
#   DEADLINE_S  the whole script's budget; a model starts only with MIN_MODEL_S left, and each
#               workload is cut at what is left
#   WORKLOADS   which of "random rate gsp" to run (default all three)
#   SERVER_ARGS extra launch_server flags (e.g. --disable-overlap-schedule)
#   N_RANDOM IN_LEN OUT_LEN / N_RATE RATE / GSP_GROUPS GSP_PER GSP_SYS GSP_Q GSP_OUT: sizes
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
if [ -z "${SKIP_WHEELS:-}" ]; then  # SKIP_WHEELS=1: the current python as it is (a CPU test)
  . scripts/gpu_run.sh || exit 1
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
fi
OUT=${OUT:-runs/serving}
mkdir -p "$OUT"
MODELS=${MODELS:-benchmarks/configs/qwen2-7b}
TOKENIZER=${TOKENIZER-.qwen2-tokenizer}
PORT=${PORT:-30000}
DEADLINE_S=${DEADLINE_S:-500}
MIN_MODEL_S=${MIN_MODEL_S:-200}
START_TIMEOUT_S=${START_TIMEOUT_S:-240}
N_RANDOM=${N_RANDOM:-1000} IN_LEN=${IN_LEN:-1024} OUT_LEN=${OUT_LEN:-512}
N_RATE=${N_RATE:-300} RATE=${RATE:-5}
GSP_GROUPS=${GSP_GROUPS:-64} GSP_PER=${GSP_PER:-16} GSP_SYS=${GSP_SYS:-2048} GSP_Q=${GSP_Q:-128} GSP_OUT=${GSP_OUT:-256}
WORKLOADS=${WORKLOADS:-random rate gsp}
SERVER_ARGS=${SERVER_ARGS:-}
RESULTS=$OUT/results.jsonl
left() { echo $((DEADLINE_S - ($(date +%s) - T0))); }
log() { echo "[$(( $(date +%s) - T0 ))s] $*"; }

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"

. scripts/server_process.sh

bench() {  # workload, label, then bench_serving arguments
  local workload=$1 label=$2; shift 2
  case " $WORKLOADS " in *" $workload "*) ;; *) return ;; esac
  local budget; budget=$(left)
  if [ "$budget" -lt 20 ]; then log "skip $label: ${budget}s left"; return; fi
  log "run $label (at most ${budget}s)"
  timeout -k 5 "$budget" python3 -m radixserve.bench_serving --backend openai --port "$PORT" \
    ${TOKENIZER:+--tokenizer "$TOKENIZER"} --flush-cache --disable-tqdm --output-file "$RESULTS" "$@" \
    || log "$label: exit $?"
}

for model in $MODELS; do
  if [ "$(left)" -lt "$MIN_MODEL_S" ]; then log "skip $model: $(left)s left"; continue; fi
  name=$(basename "$model")
  args=()
  [ "$model" != tiny ] && args+=(--model-path "$model" --load-format dummy)
  [ -n "$TOKENIZER" ] && args+=(--tokenizer-path "$TOKENIZER")
  log "start server: $model"
  # shellcheck disable=SC2086
  if ! start_server "$OUT/server-$name" "${args[@]}" $SERVER_ARGS; then log "server $model did not come up"; continue; fi
  log "server up"
  bench random "$name random ${IN_LEN}/${OUT_LEN} x${N_RANDOM}" --dataset-name random-ids --num-prompts "$N_RANDOM" \
    --random-input-len "$IN_LEN" --random-output-len "$OUT_LEN" --request-rate inf
  bench rate "$name random rate $RATE x${N_RATE}" --dataset-name random-ids --num-prompts "$N_RATE" \
    --random-input-len "$IN_LEN" --random-output-len "$OUT_LEN" --request-rate "$RATE"
  bench gsp "$name gsp ${GSP_GROUPS}x${GSP_PER}" --dataset-name generated-shared-prefix --prompt-ids \
    --gsp-num-groups "$GSP_GROUPS" --gsp-prompts-per-group "$GSP_PER" --gsp-system-prompt-len "$GSP_SYS" \
    --gsp-question-len "$GSP_Q" --gsp-output-len "$GSP_OUT" --request-rate inf
  stop_server
done

log "summary"
python3 - "$RESULTS" <<'PY' | tee "$OUT/summary.md"
import json, os, sys
path = sys.argv[1]
rows = [json.loads(l) for l in open(path)] if os.path.exists(path) else []
print("| model | workload | ok/failed | duration s | output tok/s | total tok/s | TTFT p50 / p99 ms | TPOT mean ms | hit rate (resp / metrics / oracle) |")
print("|---|---|---|---|---|---|---|---|---|")
for r in rows:
    s, ss = r["settings"], r.get("server_settings") or {}
    model = os.path.basename(ss.get("model_path") or "tiny")
    if ss.get("quantization"):
        model += f" ({ss['quantization']})"
    if ss.get("kv_cache_dtype", "auto") != "auto":
        model += f" (kv {ss['kv_cache_dtype']})"
    if s["dataset_name"] == "generated-shared-prefix":
        w = f"gsp {s['gsp_num_groups']}x{s['gsp_prompts_per_group']}"
    else:
        w = f"random {s['random_input_len']}/{s['random_output_len']} x{s['num_prompts']} rate {s['request_rate']}"
    f = lambda v, d=3: "n/a" if v is None else f"{v:.{d}f}"
    print(f"| {model} | {w} | {r['completed']}/{r['failed']} | {r['duration_s']:.1f} | {r['output_throughput']:,.0f} | "
          f"{r['total_throughput']:,.0f} | {r['ttft_ms']['median']:,.1f} / {r['ttft_ms']['p99']:,.1f} | "
          f"{r['tpot_ms']['mean']:.2f} | {f(r.get('hit_rate'))} / {f(r.get('metrics_hit_rate'))} / {f(r.get('oracle_hit_rate'))} |")
    if r["failed"]:
        print(f"|   | failures: {r['failure_reasons']} |")
    if r.get("client_loop_stalls"):
        print(f"|   | the client's event loop stalled {r['client_loop_stalls']} times (worst {r['client_loop_max_lag_ms']:.0f} ms) |")
PY
# Stalls the servers logged (a step over 250 ms with its kernel compiles / allocator retries, a
# garbage collection over 50 ms): none are expected while serving.
for f in "$OUT"/server-*.log; do
  [ -e "$f" ] || continue
  echo "$(basename "$f"): $(grep -c 'slow step:' "$f") slow steps, $(grep -c 'garbage collection of generation' "$f") long collections, $(grep -c 'event loop stalled' "$f") event-loop stalls" \
    | tee -a "$OUT/summary.md"
  grep 'slow step:\|event loop stalled' "$f" | head -8
done
log "done"
