#!/usr/bin/env bash
# Run a command against a freshly started local stack: `serve-app run --config $CONFIG` in its own
# process group, wait until its engines are up (GET /ready), run "$@", then stop the stack cleanly.
# usage: bench/with_local_stack.sh COMMAND [ARGS...]   (CONFIG, PORT, PYTHON, STACK_LOG,
# READY_TIMEOUT_S from the env)
set -uo pipefail
CONFIG=${CONFIG:-deployments/local-cpu.yaml}
PORT=${PORT:-8000}
PY=${PYTHON:-.venv/bin/python}
LOG=${STACK_LOG:-bench/out/stack-server.log}
mkdir -p "$(dirname "$LOG")"
setsid "$PY" -m serve_app.cli run --config "$CONFIG" --port "$PORT" > "$LOG" 2>&1 &
STACK=$!
# TERM to serve-app alone: it shuts Serve down (which stops HAProxy) before Ray; signalling the
# whole group at once would kill Serve's actors first and orphan HAProxy on the port.
trap 'kill -TERM $STACK 2>/dev/null; for _ in $(seq 90); do kill -0 $STACK 2>/dev/null || break; sleep 1; done; kill -KILL -- -$STACK 2>/dev/null' EXIT
T0=$(date +%s)
# Ready = every model kept warm has a live engine (/v1/models answers while one still loads).
until "$PY" -c "from serve_app.launch import is_ready; raise SystemExit(not is_ready('http://127.0.0.1:$PORT'))" 2>/dev/null; do
  kill -0 $STACK 2>/dev/null || { echo "stack exited; see $LOG"; exit 1; }
  [ $(( $(date +%s) - T0 )) -lt "${READY_TIMEOUT_S:-300}" ] || { echo "stack not ready; see $LOG"; exit 1; }
  sleep 1
done
echo "stack ready after $(( $(date +%s) - T0 ))s (log: $LOG)"
"$@"
