#!/usr/bin/env bash
# One round of GPU checks from a bare machine: the GPU suite, then the benchmark rows, each stage
# writing its results as soon as it has them, so a call that is cut short keeps what it measured.
# On the GPU machine, from the repository root, with .whl and .qwen2-tokenizer carried:
#
#   VERIFY_COMMIT=abc1234 bash scripts/gpu_verify.sh suite hybrid27b   # stages run in the order given
#
# Stages:
#   suite       tests/gpu (or SUITE_FILES) with -n 8 and a per-test timeout, then the tests that failed
#               again, alone and verbose (their output names what went wrong)
#   memory      the 7B at the default memory fraction and at 0.90: random burst, gsp, agent
#   hybrid27b   Qwen3.5-27B, agent workload at the 216,825-token pool: our default and our host tier
#               4x (HYBRID_CONFIGS), then gsp 64x16 (hit against the unlimited oracle)
#   smoke27b    Qwen3.5-27B with --max-total-tokens 216825 starts (its snapshots fit in what the memory
#               fraction leaves beside that pool) and serves gsp 8x8 with hits; its memory line
#   peers27b    SGLang and vLLM on the same agent workload (their bundles unpacked under /tmp)
#   qwen3       Qwen3-8B and Qwen3-30B-A3B beside the peers: random, rate 5, gsp
#   storage     the storage tier on the 7B: a 16k-token prefix's TTFT from disk against computing it
#               (scripts/gpu_storage_bench.py; the directory under STORAGE_ROOT, default /tmp), then
#               the agent workload with a host tier of 1x the pool (STORAGE_POOL tokens, default
#               216825), alone and with the storage tier below it, alternated (STORAGE_CONFIGS)
#
# Writes under $OUT (else runs/verify): verify.jsonl, one line per finished row
# ({"stage", "label", "commit", "device", ...the row}), suite.log, and logs-STAGE.tar.gz with each
# stage's server logs. VERIFY_DEADLINE_S bounds the whole script (default 570: one call's 600 s).
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
STAGES=("$@")
set --  # gpu_run.sh runs its arguments as a command
. scripts/gpu_run.sh || exit 1
OUT=${OUT:-runs/verify}
mkdir -p "$OUT"
ROWS=$OUT/verify.jsonl
VERIFY_DEADLINE_S=${VERIFY_DEADLINE_S:-570}
WORK=/tmp/verify
mkdir -p "$WORK"
COMMIT=${VERIFY_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}  # the checkout that travels may carry no history
DEVICE=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
left() { echo $((VERIFY_DEADLINE_S - ($(date +%s) - T0))); }
log() { echo "[verify $(( $(date +%s) - T0 ))s] $*"; }

# row STAGE LABEL JSON: one line of verify.jsonl.
row() {
  python3 - "$1" "$2" "$3" "$COMMIT" "$DEVICE" >> "$ROWS" <<'EOF'
import json, sys, time
stage, label, body, commit, device = sys.argv[1:6]
record = {"stage": stage, "label": label, "commit": commit, "device": device,
          "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
record.update(json.loads(body))
print(json.dumps(record))
EOF
}

# bench_rows STAGE FILE: each bench_serving record of FILE (one JSON per line) becomes a row.
bench_rows() {
  local stage=$1 file=$2
  [ -f "$file" ] || return 0
  while IFS= read -r line; do
    label=$(python3 -c 'import json,sys
r = json.loads(sys.argv[1]); s = r.get("server_settings") or {}
extra = [f"{k}={s[k]}" for k in ("schedule_policy", "hicache_ratio", "mem_fraction_static", "quantization") if s.get(k)]
print(" ".join([r.get("settings", {}).get("dataset_name", "run"), *extra]))' "$line")
    row "$stage" "$label" "$line"
  done < "$file"
}

pack_logs() {  # few files come back: one archive per stage
  tar -C "$WORK" -czf "$OUT/logs-$1.tar.gz" "$1" 2>/dev/null
}

stage_suite() {
  local budget=$(( $(left) - 30 ))
  [ "$budget" -lt 120 ] && { log "suite: skipped, ${budget}s left"; return; }
  log "suite: ${SUITE_FILES:-tests/gpu} -n 8 within ${budget}s"
  mkdir -p "$WORK/suite"
  # shellcheck disable=SC2086
  timeout -k 10 "$budget" python3 -m pytest -q -n 8 ${SUITE_FILES:-tests/gpu} --timeout 240 -rfEs -p no:cacheprovider \
    --junitxml "$WORK/suite/junit.xml" > "$OUT/suite.log" 2>&1
  log "suite: $(tail -1 "$OUT/suite.log")"
  row suite summary "$(python3 - "$WORK/suite/junit.xml" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except Exception as exc:  # a suite killed at its budget writes no report
    print(json.dumps({"error": f"no junit report: {exc}"})); sys.exit()
failed, counts = [], {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
for case in root.iter("testcase"):
    name = f"{case.get('classname')}::{case.get('name')}"
    if case.find("failure") is not None:
        counts["failed"] += 1; failed.append(name)
    elif case.find("error") is not None:
        counts["error"] += 1; failed.append(name)
    elif case.find("skipped") is not None:
        counts["skipped"] += 1
    else:
        counts["passed"] += 1
suite = next(root.iter("testsuite"))
print(json.dumps({**counts, "seconds": float(suite.get("time", 0)), "failed_tests": failed}))
EOF
)"
  # The failures again, one process, verbose: what they print says whether the test or the engine is wrong.
  local failed
  failed=$(python3 - "$WORK/suite/junit.xml" <<'EOF2'
import sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except Exception:
    sys.exit()
ids = []
for case in root.iter("testcase"):
    if case.find("failure") is None and case.find("error") is None:
        continue
    parts = case.get("classname").split(".")  # tests.gpu.test_mod[.TestClass]
    mod = next(i for i, p in enumerate(parts) if p.startswith("test_"))
    ids.append("::".join(["/".join(parts[: mod + 1]) + ".py", *parts[mod + 1 :], case.get("name")]))
print(" ".join(ids))
EOF2
)
  if [ -n "$failed" ] && [ "$(left)" -gt 90 ]; then
    log "suite: rerunning the failures alone"
    # shellcheck disable=SC2086
    timeout -k 10 $(( $(left) - 60 )) python3 -m pytest -p no:cacheprovider --timeout 240 -q -rfE -s --tb=long \
      $failed > "$OUT/suite-failures.log" 2>&1
  fi
  pack_logs suite
}

stage_memory() {
  log "memory: 7B at the default fraction and at 0.90"
  mkdir -p "$WORK/memory"
  OUT=$WORK/memory DEADLINE_S=$(( $(left) - 20 )) WORKLOADS="random gsp agent" \
    CONFIGS="bf16-default: bf16-090:--mem-fraction-static,0.90" bash scripts/gpu_memory_bench.sh
  bench_rows memory "$WORK/memory/results.jsonl"
  pack_logs memory
}

stage_hybrid27b() {
  log "hybrid27b: Qwen3.5-27B agent workload, default and host tier 4x"
  mkdir -p "$WORK/hybrid27b"
  OUT=$WORK/hybrid27b MODEL=benchmarks/configs/qwen3.5-27b DEADLINE_S=$(( $(left) - 20 )) MIN_LEFT_S=150 \
    CONFIGS=${HYBRID_CONFIGS:-"default:--schedule-policy,lpm hicache4:--schedule-policy,lpm,--hicache-ratio,4"} \
    bash scripts/gpu_agent_bench.sh
  bench_rows hybrid27b "$WORK/hybrid27b/results.jsonl"
  if [ "$(left)" -gt 150 ]; then
    OUT=$WORK/hybrid27b-gsp MODEL=benchmarks/configs/qwen3.5-27b WORKLOAD=gsp DEADLINE_S=$(( $(left) - 20 )) \
      CONFIGS="gsp:--schedule-policy,lpm" bash scripts/gpu_agent_bench.sh
    bench_rows hybrid27b "$WORK/hybrid27b-gsp/results.jsonl"
  fi
  pack_logs hybrid27b
}

stage_smoke27b() {
  [ "$(left)" -lt 150 ] && { log "smoke27b: skipped, $(left)s left"; return; }
  log "smoke27b: Qwen3.5-27B at --max-total-tokens 216825"
  mkdir -p "$WORK/smoke27b"
  PORT=${PORT:-30000}
  . scripts/server_process.sh
  if start_server "$WORK/smoke27b/server" --model-path benchmarks/configs/qwen3.5-27b --load-format dummy \
      --tokenizer-path .qwen2-tokenizer --max-total-tokens 216825; then
    timeout -k 5 $(( $(left) - 30 )) python3 -m radixserve.bench_serving --backend openai --port "$PORT" \
      --tokenizer .qwen2-tokenizer --dataset-name generated-shared-prefix --prompt-ids --gsp-num-groups 8 \
      --gsp-prompts-per-group 8 --gsp-system-prompt-len 2048 --gsp-question-len 128 --gsp-output-len 32 \
      --request-rate inf --disable-tqdm --output-file "$WORK/smoke27b/results.jsonl" > "$WORK/smoke27b/bench.txt" 2>&1
    grep -iE "hit|Successful|Failed|throughput" "$WORK/smoke27b/bench.txt"
    bench_rows smoke27b "$WORK/smoke27b/results.jsonl"
  else
    row smoke27b start '{"error": "the server did not come up"}'
  fi
  grep -hE "snapshots|memory:|WARNING|ERROR" "$WORK/smoke27b/server.log" | cut -c1-400 | head -8
  stop_server
  pack_logs smoke27b
}

stage_peers27b() {
  log "peers27b: SGLang and vLLM on the 27B agent workload"
  mkdir -p "$WORK/peers27b"
  OUT=$WORK/peers27b MODEL=benchmarks/configs/qwen3.5-27b ENGINES="sglang vllm" WORKLOADS=agent \
    DEADLINE_S=$(( $(left) - 20 )) VLLM_ARGS="--language-model-only" bash scripts/gpu_peer_bench.sh
  for f in "$WORK"/peers27b/*.jsonl; do bench_rows peers27b "$f"; done
  pack_logs peers27b
}

stage_qwen3() {
  for model in qwen3-8b qwen3-30b-a3b; do
    [ "$(left)" -lt 200 ] && { log "qwen3: $model skipped, $(left)s left"; continue; }
    log "qwen3: $model beside the peers"
    mkdir -p "$WORK/qwen3/$model"
    OUT=$WORK/qwen3/$model MODEL=benchmarks/configs/$model DEADLINE_S=$(( $(left) - 20 )) \
      bash scripts/gpu_peer_bench.sh
    for f in "$WORK/qwen3/$model"/*.jsonl; do bench_rows "qwen3-$model" "$f"; done
  done
  pack_logs qwen3
}

stage_storage() {
  [ "$(left)" -lt 150 ] && { log "storage: skipped, $(left)s left"; return; }
  log "storage: a 16k prefix from disk against recompute, then the agent workload over a small host tier"
  mkdir -p "$WORK/storage"
  local root=${STORAGE_ROOT:-/tmp}
  timeout -k 5 $(( $(left) / 3 )) python3 scripts/gpu_storage_bench.py --out "$WORK/storage/ttft.json" \
    --storage-dir "$root/radixserve-storage" > "$WORK/storage/ttft.log" 2>&1
  tail -5 "$WORK/storage/ttft.log"
  [ -s "$WORK/storage/ttft.json" ] && row storage "ttft-16k $root" "$(cat "$WORK/storage/ttft.json")"
  rm -rf "$root/radixserve-storage" /tmp/verify-storage-dir /dev/shm/verify-storage-dir
  OUT=$WORK/storage/agent DEADLINE_S=$(( $(left) - 20 )) POOL=${STORAGE_POOL:-216825} \
    CONFIGS=${STORAGE_CONFIGS:-"host1x:--hicache-ratio,1,--page-size,16 host1x-disk:--hicache-ratio,1,--page-size,16,--storage-dir,/tmp/verify-storage-dir"} \
    bash scripts/gpu_agent_bench.sh
  bench_rows storage "$WORK/storage/agent/results.jsonl"
  pack_logs storage
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,power.limit --format=csv,noheader
row start machine "$(python3 -c 'import json,torch,triton; print(json.dumps({"torch": torch.__version__, "triton": triton.__version__}))')"
for stage in "${STAGES[@]}"; do
  case $stage in
    suite|memory|hybrid27b|smoke27b|peers27b|qwen3|storage) "stage_$stage" ;;
    *) log "unknown stage $stage" ;;
  esac
  log "$stage done, $(left)s left"
done
