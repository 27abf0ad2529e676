# Shared by the GPU bench scripts (source it): start an arm only on a free port.
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
