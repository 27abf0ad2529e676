# Shared by the GPU bench scripts (source it): start an arm only on a free port, wait for the
# arm's own server, stop it and whatever it left.
#
# A server left running by an earlier command (one cut off by its time limit survives in its
# own session) answered on port 8000 while the arm meant to be measured failed to bind it, and
# wait_ready took the old server for the new one: a whole arm measured the wrong server (seen
# 2026-12-02, bench/RESULTS.md section 12).

require_free_port() {  # port: fail loudly when something listens there
  if python3 - "$1" <<'PY'
import socket, sys
s = socket.socket()
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    sys.exit(0)
sys.exit(1)
PY
  then
    echo "port $1 is in use before the arm starts: refusing to measure another server" >&2
    ss -ltnp 2>/dev/null | grep ":$1 " >&2
    return 1
  fi
}

wait_ready() {  # url pid timeout [api-key]: the arm's own server answers (and is still alive)
  local t=0
  until ${PY:-python3} -c "import sys, urllib.request as u; h = {'Authorization': 'Bearer ' + sys.argv[2]} if sys.argv[2] else {}; u.urlopen(u.Request(sys.argv[1] + '/v1/models', headers=h), timeout=3)" \
      "$1" "${4:-}" 2>/dev/null; do
    sleep 2; t=$((t + 2))
    if ! kill -0 "$2" 2>/dev/null || [ $t -ge "$3" ]; then echo "not ready after ${t}s"; return 1; fi
  done
  kill -0 "$2" 2>/dev/null || { echo "the arm's server exited; another answered"; return 1; }
  echo "ready after ${t}s"
}

stop() {  # pid: ask the server to shut down cleanly (serve-app stops Serve and HAProxy before
  # Ray), then remove whatever is left of its process group
  kill -TERM "$1" 2>/dev/null
  for _ in $(seq 90); do kill -0 "$1" 2>/dev/null || break; sleep 1; done
  kill -KILL -- -"$1" 2>/dev/null; sleep 2
}
