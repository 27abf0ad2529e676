# Shared by the GPU bench scripts (source it): start an arm only on a free port, wait for the
# arm's own server, stop it and whatever it left.
#
# A server left running by an earlier command (one cut off by its time limit survives in its
# own session) answered on port 8000 while the arm meant to be measured failed to bind it, and
# wait_ready took the old server for the new one: a whole arm measured the wrong server (seen
# 2026-12-02, bench/RESULTS-archive.md section 12).

# The benchmark package (bench/serve_bench, `python -m serve_bench.arms`) is importable without
# installing the checkout (the GPU hosts put only the repository root on PYTHONPATH).
export PYTHONPATH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)${PYTHONPATH:+:$PYTHONPATH}"

require_free_port() {  # port: fail loudly when something listens there
  if python3 - "$1" <<'PY'
import socket, sys
s = socket.socket()
# A listener still fails the bind with SO_REUSEADDR; the last server's closed connections in
# TIME_WAIT do not (without it they did, and a free port read as taken).
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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
  # and its engines are up: the stack's /ready is 200 (its /v1/models answers while an engine
  # still loads, and a whole arm once measured a loading stack, RESULTS 42c); bare vLLM has
  # no /ready (404) and answers /v1/models only once loaded.
  local t=0
  until ${PY:-python3} - "$1" "${4:-}" 2>/dev/null <<'PY'
import sys, urllib.error, urllib.request as u
base, key = sys.argv[1], sys.argv[2]
u.urlopen(u.Request(base + "/v1/models", headers={"Authorization": "Bearer " + key} if key else {}),
          timeout=3)
try:
    u.urlopen(base + "/ready", timeout=3)
except urllib.error.HTTPError as e:
    sys.exit(0 if e.code == 404 else 1)
PY
  do
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

pyspy_parts() {  # dir name seconds part...: py-spy (raw stacks, 100 Hz) on each part's process
  # for that long, in the background; PYSPY_PIDS gets the recorders' pids to wait for. Parts:
  # api-server (bare vLLM's), LLMServer and Router (the stack's Serve replicas). Each profile
  # goes to DIR/NAME-PART.pyspy.txt; pyspy_summaries turns them into tables.
  local dir=$1 name=$2 secs=$3 part pid
  shift 3
  PYSPY_PIDS=()
  command -v py-spy > /dev/null || { echo "no py-spy on this host"; return 0; }
  for part in "$@"; do
    if [ "$part" = api-server ]; then pid=$(pgrep -f "serve_app.cli vllm serve" | head -n 1)
    else pid=$(pgrep -f "ServeReplica:.*:${part}" | head -n 1); fi
    [ -n "$pid" ] || { echo "no $part process"; continue; }
    cat /proc/sys/kernel/yama/ptrace_scope > "$dir/$name-$part.pyspy.log" 2>&1
    py-spy record --nonblocking -p "$pid" -d "$secs" -r 100 -f raw \
      -o "$dir/$name-$part.pyspy.txt" >> "$dir/$name-$part.pyspy.log" 2>&1 &
    PYSPY_PIDS+=($!)
  done
}

pyspy_summaries() {  # dir name title part...: a markdown table per profile that has samples
  local dir=$1 name=$2 title=$3 part
  shift 3
  for part in "$@"; do
    [ -s "$dir/$name-$part.pyspy.txt" ] && ${PY:-python3} bench/profile_summary.py \
      "$dir/$name-$part.pyspy.txt" --title "$title, $part" --top 20 > "$dir/$name-$part.profile.md"
  done
}

ensure_model() {  # config: write the config's model folder if it is missing (a model the
  # project makes itself: SHAPE, else the 8B shape for a GPU model and the tiny one for a CPU
  # model; a CPU engine given the 8B config-only folder fails to start)
  local path device
  read -r path device < <(${PY:-python3} -c "from serve_app.config import load_config as l; m = l('$1').models[0]; print(m.path, m.device)")
  [ -e "$path" ] && return 0
  local shape=${SHAPE:-tiny}
  [ -z "${SHAPE:-}" ] && [ "$device" = gpu ] && shape=llama-3.1-8b
  ${PY:-python3} -m serve_app.cli make-model "$shape" --out "$path"
}

start_cluster() {  # dir gpus [cpus]: a local Ray cluster of one node per listed GPU
  # (tests/integration/local_cluster.py: "0,0" is two nodes sharing device 0, "0,1" one device
  # each); sets CLUSTER (its pid) and ADDRESS, and stops it (stop_cluster) when the script exits.
  # The cluster runs until its stdin closes, then shuts its nodes down: its stdin is a fifo
  # whose only writer is this script (a `sleep` holding it open outlived the script, and with
  # it whatever file the script had open, such as a lock).
  local dir=$1
  rm -f "$dir/cluster.stdin" "$dir/cluster.json"
  mkfifo "$dir/cluster.stdin"
  CLUSTER_GPUS=$2 CLUSTER_CPUS=${3:-8} ${PY:-python3} -m tests.integration.local_cluster serve \
    < "$dir/cluster.stdin" > "$dir/cluster.json" 2> "$dir/cluster.log" &
  CLUSTER=$!
  exec {CLUSTER_HOLD}> "$dir/cluster.stdin"
  trap 'stop_cluster' EXIT
  for _ in $(seq 120); do [ -s "$dir/cluster.json" ] && break; sleep 1; done
  ADDRESS=$(${PY:-python3} -c "import json, sys; print(json.load(open(sys.argv[1]))['address'])" \
    "$dir/cluster.json") || { tail -n 30 "$dir/cluster.log"; stop_cluster; return 1; }
}

stop_cluster() {  # Serve (its HAProxy with it) down first, then the cluster's nodes
  [ -n "${CLUSTER:-}" ] || return 0
  [ -n "${ADDRESS:-}" ] && timeout 60 ${PY:-python3} -c "import ray, sys; from ray import serve; ray.init(address=sys.argv[1], log_to_driver=False); serve.shutdown()" \
    "$ADDRESS" > /dev/null 2>&1
  exec {CLUSTER_HOLD}>&-
  for _ in $(seq 120); do kill -0 "$CLUSTER" 2>/dev/null || break; sleep 1; done
  kill "$CLUSTER" 2>/dev/null
  CLUSTER=
}

pack_results() {  # dir: where $OUT is set, replace dir by one tarball of it (dir.tgz)
  # The lent GPU host sends back at most 8 files from $OUT, none deeper than two folders: a
  # flood call's twenty-odd files lost every stack-arm file (2026-12-05, RESULTS 42d), and the
  # LoRA runs' per-arm folders were too deep. The tarball holds them all, and the folder goes so
  # that its files do not crowd the tarball out of the eight. Without $OUT the folder stays.
  [ -n "${OUT:-}" ] && [ -d "$1" ] || return 0
  tar czf "$1.tgz" -C "$(dirname "$1")" "$(basename "$1")" && rm -rf "$1" && echo "packed into $1.tgz"
}
