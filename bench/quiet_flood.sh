#!/usr/bin/env bash
# Issue 42's CPU figure: a quiet tenant's first token beside a flood, on the embedded default.
# One tenant keeps FLOOD_C (96) non-streaming requests (FLOOD_IN/FLOOD_OUT tokens) in flight;
# another sends one streamed request (64 in / 8 out) at a time, first alone (ALONE_S) and then
# beside the flood (`serve-app flood`, bench/serve_bench/flood.py). Where the quiet request's time
# went comes from the stack's Server-Timing (router queue, Serve's hop, the engine's queue,
# prefill); the engines' running/waiting and the router's queue and capacity are sampled from
# Ray's metrics agents; each process's CPU from bench/proc_cpu.py (the load client shares the
# machine's cores with the stack).
# RESERVES (default: the config's own): the paired A/B of `router.admission.batch_reserve`, one
# arm per value, each on a fresh stack, in that order (e.g. "0 2 0 2": two pairs, alternated).
# usage: bench/quiet_flood.sh   (env: CONFIG=deployments/local-cpu.yaml, FLOOD_C=96,
#   FLOOD_IN=128, FLOOD_OUT=128, DURATION_S=30, ALONE_S=20, RESERVES, PYTHON,
#   OUT_DIR=bench/out/quiet-flood)
# Writes per arm OUT_DIR[/reserve-R-K]/quiet-flood.json (every quiet request with its phases),
# quiet-flood.txt (the summary line) and cpu.md; with RESERVES, OUT_DIR/summary.txt (one line
# per arm). Results: bench/RESULTS.md 42a.
set -uo pipefail
. "$(dirname "$0")/arm_lib.sh"
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT_DIR:-bench/out/quiet-flood}
CONFIG=${CONFIG:-deployments/local-cpu.yaml}
mkdir -p "$OUT"
FLOOD_KEY=$("$PY" -c "from serve_app.governance.keys import new_key; print(new_key())")
QUIET_KEY=$("$PY" -c "from serve_app.governance.keys import new_key; print(new_key())")
STACK=
trap '[ -n "$STACK" ] && stop $STACK' EXIT

arm() {  # out-dir reserve (empty: the config's): one stack, the quiet tenant alone then beside
  # the flood; the summary line on stdout
  local OUT=$1
  mkdir -p "$OUT"
  "$PY" - "$CONFIG" "$FLOOD_KEY" "$QUIET_KEY" "$2" > "$OUT/config.yaml" <<'PY'
import sys
from pathlib import Path

import yaml

from serve_app.config import load_config
from serve_app.governance.keys import key_digest

path, flood, quiet, reserve = sys.argv[1:5]
cfg = yaml.safe_load(Path(path).read_text())
cfg["models"][0]["path"] = str(load_config(path).models[0].path)  # as it was resolved
cfg.setdefault("router", {})["server_timing"] = True  # the quiet requests' phases
if reserve:  # this arm's batch_reserve (RESERVES)
    cfg["router"].setdefault("admission", {})["batch_reserve"] = int(reserve)
cfg["tenants"] = [{"name": "flood", "api_key_sha256": [key_digest(flood)]},
                  {"name": "quiet", "api_key_sha256": [key_digest(quiet)]}]
print(yaml.safe_dump(cfg, sort_keys=False))
PY
  MODEL=$("$PY" -c "from serve_app.config import load_config as l; print(l('$OUT/config.yaml').models[0].name)")
  require_free_port 8000 || return 1
  setsid "$PY" -m serve_app.cli run --config "$OUT/config.yaml" --port 8000 > "$OUT/server.log" 2>&1 &
  STACK=$!
  wait_ready http://127.0.0.1:8000 $STACK 300 "$QUIET_KEY" || { stop $STACK; return 1; }
  METRICS=$("$PY" -c "import json; print(' '.join('--metrics-url http://%s/metrics' % t for g in json.load(open('/tmp/ray/prom_metrics_service_discovery.json')) for t in g['targets']))" 2>/dev/null)
  "$PY" bench/proc_cpu.py --out "$OUT/cpu.md" --title "quiet beside a ${FLOOD_C:-96}-way flood" \
    --threads 3 -- "$PY" -m serve_app.cli flood --base-url http://127.0.0.1:8000 --model "$MODEL" \
    --flood-key "$FLOOD_KEY" --quiet-key "$QUIET_KEY" --flood-concurrency "${FLOOD_C:-96}" \
    --flood-in "${FLOOD_IN:-128}" --flood-out "${FLOOD_OUT:-128}" --quiet-in 64 --quiet-out 8 \
    --duration-s "${DURATION_S:-30}" --settle-s 8 --alone-s "${ALONE_S:-20}" --token-range 10-500 \
    --quiet-process $METRICS --out "$OUT/quiet-flood.json" --label "quiet beside flood${2:+ (batch_reserve $2)}" 2>&1 \
    | grep "^quiet beside flood" | tee "$OUT/quiet-flood.txt"
  stop $STACK
  STACK=
}

if [ -z "${RESERVES:-}" ]; then
  arm "$OUT" ""
  exit
fi
: > "$OUT/summary.txt"
k=0
for r in $RESERVES; do
  k=$((k + 1))
  arm "$OUT/reserve-$r-$k" "$r" && cat "$OUT/reserve-$r-$k/quiet-flood.txt" >> "$OUT/summary.txt" \
    || echo "arm $k (batch_reserve $r) failed" | tee -a "$OUT/summary.txt"
done
