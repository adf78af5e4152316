# Sourced by the GPU benchmark scripts: one server process at a time, stopped on exit.
#   start_server LOG_PREFIX ARGS...   starts `launch_server ARGS`, waits up to START_TIMEOUT_S
#                                     (default 240) for /health on $PORT; returns 1 if it never came up
#   stop_server                       SIGTERM, then SIGKILL after 30 s
SERVER_PID=""
stop_server() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill "$SERVER_PID"; for _ in $(seq 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -9 "$SERVER_PID" 2>/dev/null
  fi
  SERVER_PID=""
}
trap stop_server EXIT

start_server() {
  local prefix=$1; shift
  python3 -m radixserve.launch_server "$@" --port "$PORT" --log-file "$prefix.log" > "$prefix.out" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq "${START_TIMEOUT_S:-240}"); do
    kill -0 "$SERVER_PID" 2>/dev/null || break
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then return 0; fi
    sleep 1
  done
  tail -20 "$prefix.out"
  stop_server
  return 1
}
