# Sourced by the GPU benchmark scripts: one server process at a time, stopped on exit.
#   start_server LOG_PREFIX ARGS...   starts `launch_server ARGS`, waits up to START_TIMEOUT_S
#                                     (default 240) for /health on $PORT; returns 1 if it never came up
#   stop_server                       SIGTERM, then SIGKILL after 30 s (the console copy of the
#                                     log is dropped when it holds nothing more than the log)
#   start_monitor FILE / stop_monitor  every second until stopped: GPU clocks, power and use, and
#                                     the busiest threads with the core each ran on (where the time
#                                     of a host-bound run went); the NUMA layout and the engine's
#                                     CPU mask once at the start
SERVER_PID=""
SERVER_PREFIX=""
MONITOR_PID=""
stop_server() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill "$SERVER_PID"; for _ in $(seq 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -9 "$SERVER_PID" 2>/dev/null
  fi
  if [ -n "$SERVER_PREFIX" ] && cmp -s "$SERVER_PREFIX.log" "$SERVER_PREFIX.out"; then rm -f "$SERVER_PREFIX.out"; fi
  SERVER_PID=""
  SERVER_PREFIX=""
}
start_monitor() {
  local file=$1
  {
    lscpu | grep -iE "^CPU\(s\)|NUMA|Model name|MHz"
    nvidia-smi topo -m 2>/dev/null | head -4
    # Which logical CPUs share a physical core (two busy processes on siblings each run slower).
    lscpu -e=CPU,CORE,SOCKET,NODE 2>/dev/null
    for pid in $(pgrep -f radixserve.engine.engine_process); do echo "engine $pid: $(taskset -pc "$pid" 2>/dev/null)"; done
    while :; do
      echo "== $(date +%T.%N | cut -c1-12)"
      nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,utilization.gpu,temperature.gpu --format=csv,noheader
      # The second of two samples half a second apart (the first one's %CPU is since boot): the
      # machine's CPU line (its "st" is time a virtual machine's CPUs waited for the host), then the
      # busiest threads, each with its last core (ps psr) in front.
      sample=$(top -b -H -n 2 -d 0.5 -w 160 -o %CPU | awk '/^top -/ {n++} n == 2')
      grep -m1 '^%Cpu' <<< "$sample"
      sed -n '8,19p' <<< "$sample" \
        | awk 'NR == FNR {core[$1] = $2; next} {print "cpu " core[$1] "\t" $0}' <(ps -eLo tid=,psr=) -
      sleep 1
    done
  } > "$file" 2>&1 &
  MONITOR_PID=$!
}
stop_monitor() {
  if [ -n "$MONITOR_PID" ]; then kill "$MONITOR_PID" 2>/dev/null; wait "$MONITOR_PID" 2>/dev/null; fi
  MONITOR_PID=""
}
trap 'stop_monitor; stop_server' EXIT

start_server() {
  local prefix=$1; shift
  python3 -m radixserve.launch_server "$@" --port "$PORT" --log-file "$prefix.log" > "$prefix.out" 2>&1 &
  SERVER_PID=$!
  SERVER_PREFIX=$prefix
  for _ in $(seq "${START_TIMEOUT_S:-240}"); do
    kill -0 "$SERVER_PID" 2>/dev/null || break
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then return 0; fi
    sleep 1
  done
  tail -20 "$prefix.out"
  stop_server
  return 1
}
