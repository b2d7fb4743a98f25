# Shell helpers the serving benchmarks share (sourced): start nodes in the background, wait for
# their `ready` line, stop them (also on exit). Set WORK (logs and pid files go there) first;
# optionally PY (the python, default python3) and NODE_TIMEOUT (seconds a node may live).
PIDS=()

start_node() {  # name args...
  local name=$1; shift
  ${NODE_TIMEOUT:+timeout "$NODE_TIMEOUT"} "${PY:-python3}" -m disagg "$@" > "$WORK/$name.log" 2>&1 &
  PIDS+=($!)
  echo "$!" > "$WORK/$name.pid"
}

wait_ready() {  # name seconds
  local pid; pid=$(cat "$WORK/$1.pid")
  for _ in $(seq 1 "$2"); do
    grep -q "ready: " "$WORK/$1.log" && return 0
    kill -0 "$pid" 2>/dev/null || { echo "$1 exited"; tail -30 "$WORK/$1.log"; return 1; }
    sleep 1
  done
  echo "$1 not ready in $2 s"; tail -30 "$WORK/$1.log"; return 1
}

stop_nodes() {
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null; done
  PIDS=()
}
trap stop_nodes EXIT
