#!/usr/bin/env bash
# The one-queue scenario on one GPU, every arm in one command: a tenant (or FLOOD_TENANTS of them)
# floods the endpoint with FLOOD_C concurrent requests (1024 in / 128 out; non-streaming unless
# FLOOD_STREAM) while a quiet tenant sends one streamed request at a time (128 in / 16 out, a
# random pause between them: serve_bench/flood.py), from a client process of its own
# (`serve-app flood --quiet-process`). Arms: bare `vllm serve` (same engine arguments,
# FCFS order since it gets no priorities), the stack with two tenants, stack2 (the same with
# two router replicas, HAProxy spreading the clients) and stackpbp (the stack with the model's
# priority_before_prefill: vLLM's scheduler lets a quiet tenant's request start before the
# flood's partial prefills, serve_app/engine/vllm_scheduler.py). Each arm's server starts once and runs
# every load of LOADS in turn. Results under $OUT; summary.txt ends with each arm against the
# bare arm on the same load (serve_bench/flood_table.py: the flood's steady output and the
# engine's steady work, RESULTS 42j).
# usage: bench/gpu_flood.sh [CONFIG] [DURATION_S]     (env: PYTHON, FLOOD_C, ARMS="bare stack",
#   LOADS="FLOOD_IN/FLOOD_OUT/QUIET_IN/QUIET_OUT ..." (default "1024/128/128/16"),
#   FLOOD_TENANTS=N (the flood split over N tenants), FLOOD_STREAM=1 (the flood streamed); a
#   load's fifth field sets both for that load alone: s or u (streamed or not) and a number of
#   tenants up to FLOOD_TENANTS, e.g. LOADS="2048/128/1024/16/s3 2048/128/1024/16/u1"
#   (FLOOD_TENANTS=3) puts two of issue 42's flood shapes in one server start per arm,
#   ARM_BENCH="serve-app bench arguments" to also run the same benchmark against each arm's server
#   after its flood (the stack's with the flood tenant's key): the throughput comparison of
#   gpu_compare.sh without a second engine start per arm; summary.txt ends with each arm's
#   ratios to the first bare arm's (bench/compare_arms.py), and BUDGET_S keeps ARM_BENCH_S
#   (60 s unless set) an arm for it, e.g. the overhead row at issue 42's candidate step:
#   ARM_BENCH="--input-len 1024 --output-len 128 --num-requests 512 --concurrency 256"
#   ARMS="bare stackpbp,max_num_batched_tokens=1536" (the stack as it would ship against bare
#   vLLM as it ships),
#   ENGINE="key=value ..." engine arguments set for both arms over the config's engine_kwargs,
#   values read as YAML: e.g. ENGINE="async_scheduling=false max_num_batched_tokens=4096", the
#   engine's levers on the quiet tenant's first token, RESULTS 42c; an ARMS entry
#   ARM,KEY=VALUE[,...] is that arm with engine arguments of its own over ENGINE's, labelled
#   ARM-KEY-VALUE: ENGINE="async_scheduling=false" ARMS="bare,async_scheduling=true bare stackpbp"
#   puts vLLM's default beside the lever in one call),
#   BUDGET_S (the call's time: the first arm runs a further load only while every later arm can
#   still run as many in the time left, judged by the first arm's own start and loads and
#   STOP_S=40 per server stop; the later arms run the loads it ran, and skip one that would end
#   past BUDGET_S. Unset: no guard. On the lent host: BUDGET_S=570 inside host.sh's 585 s)
# On the lent GPU host run it as `../shared/gpu/host.sh bench/gpu_flood.sh ...` (frees the GPU
# and ports an earlier command left, sets the bundle's environment); on your own GPU machine,
# with the project installed, run it directly (`make bench-flood`).
set -uo pipefail
T_CALL=$(date +%s)
. "$(dirname "$0")/arm_lib.sh"
CONFIG=${1:-deployments/gpu-1.yaml}; DUR=${2:-60}
PY=${PYTHON:-python3}
DIR=${OUT:-bench/out}/flood
mkdir -p "$DIR"
FLOOD_C=${FLOOD_C:-768}
with_engine_args() {  # CONFIG KEY=VALUE...: the config with those engine_kwargs, on stdout
  $PY - "$@" <<'PY'
import sys
from pathlib import Path

import yaml

from serve_app.config import load_config

path, *pairs = sys.argv[1:]
cfg = yaml.safe_load(Path(path).read_text())
model = cfg["models"][0]
model["path"] = load_config(path).models[0].path  # the copy lives elsewhere: no relative path
for pair in pairs:
    key, sep, value = pair.partition("=")
    if not sep:
        sys.exit(f"ENGINE wants key=value pairs, got {pair!r}")
    model.setdefault("engine_kwargs", {})[key] = yaml.safe_load(value)
print(yaml.safe_dump(cfg, sort_keys=False))
PY
}
if [ -n "${ENGINE:-}" ]; then  # every arm's engine gets the same overrides (bare's flags follow)
  with_engine_args "$CONFIG" $ENGINE > "$DIR/engine-config.yaml" || exit 1
  CONFIG="$DIR/engine-config.yaml"
  echo "engine arguments over the config's: $ENGINE"
fi
MODEL=$($PY -c "from serve_app.config import load_config as l; print(l('$CONFIG').models[0].name)")
ensure_model "$CONFIG"
FLOOD_KEYS=()  # one per flooding tenant (FLOOD_TENANTS, 1 unless set)
for _ in $(seq "${FLOOD_TENANTS:-1}"); do
  FLOOD_KEYS+=("$($PY -c "from serve_app.governance.keys import new_key; print(new_key())")")
done
QUIET_KEY=$($PY -c "from serve_app.governance.keys import new_key; print(new_key())")
# The stack's config: the deployment plus the tenants (throwaway keys), on loopback.
$PY - "$CONFIG" "$QUIET_KEY" "${FLOOD_KEYS[@]}" > "$DIR/stack-config.yaml" <<'PY'
import sys
from pathlib import Path

import yaml

from serve_app.config import load_config
from serve_app.governance.keys import key_digest

path, quiet, *floods = sys.argv[1:]
cfg = yaml.safe_load(Path(path).read_text())
cfg["models"][0]["path"] = load_config(path).models[0].path
cfg.setdefault("router", {})["host"] = "127.0.0.1"
cfg["router"]["server_timing"] = True  # per-request phases of the quiet tenant's first token
cfg["tenants"] = [{"name": "flood" if len(floods) == 1 else f"flood-{i}",
                   "api_key_sha256": [key_digest(k)]} for i, k in enumerate(floods)]
cfg["tenants"].append({"name": "quiet", "api_key_sha256": [key_digest(quiet)]})
print(yaml.safe_dump(cfg, sort_keys=False))
PY
$PY - "$DIR/stack-config.yaml" > "$DIR/stack2-config.yaml" <<'PY'
import sys
from pathlib import Path

import yaml

cfg = yaml.safe_load(Path(sys.argv[1]).read_text())
cfg["router"]["num_replicas"] = 2
print(yaml.safe_dump(cfg, sort_keys=False))
PY
# stackpbp: the stack with the engine's scheduler change (the model's priority_before_prefill,
# serve_app/engine/vllm_scheduler.py), for the paired A/B against stack in one call.
$PY - "$DIR/stack-config.yaml" > "$DIR/stackpbp-config.yaml" <<'PY'
import sys
from pathlib import Path

import yaml

cfg = yaml.safe_load(Path(sys.argv[1]).read_text())
cfg["models"][0]["priority_before_prefill"] = True
print(yaml.safe_dump(cfg, sort_keys=False))
PY

ray_metrics_urls() {  # the metrics agents Ray lists for Prometheus
  $PY -c "import json; print(' '.join('--metrics-url http://%s/metrics' % t for g in json.load(open('/tmp/ray/prom_metrics_service_discovery.json')) for t in g['targets']))" 2>/dev/null
}
arm_bench() {  # url arm [tenant-args]
  [ -n "${ARM_BENCH:-}" ] || return 0
  $PY -m serve_app.cli bench --base-url "$1" --model "$MODEL" ${3:-} $ARM_BENCH --quiet \
    --label "$2" --out "$DIR/$2-bench" > "$DIR/$2-bench.log" 2>&1
  grep -A6 "^## Runs" "$DIR/$2-bench/summary.md" || tail -n 20 "$DIR/$2-bench.log"
}
RUN_LOADS=""  # the loads the first arm ran; the later arms run these (BUDGET_S)
N_ARMS=$(wc -w <<< "${ARMS:-bare stack}")
STOP_S=${STOP_S:-40}  # an arm's server stop (the stack's Serve shutdown takes ~30 s)
BENCH_S=0; [ -n "${ARM_BENCH:-}" ] && BENCH_S=${ARM_BENCH_S:-60}  # each arm's ARM_BENCH after its loads
fits() {  # lead arm-start loads-run first-load-start: may the next load run within BUDGET_S?
  [ -n "${BUDGET_S:-}" ] || return 0
  local now per need; now=$(date +%s)
  [ "$3" -gt 0 ] || return 0  # the first load always runs: nothing to judge by yet
  per=$(( (now - $4) / $3 ))  # one load's time so far
  need=$(( now - T_CALL + per + BENCH_S + STOP_S ))
  # the first arm leaves each later arm its own start, as many loads, its bench and its stop
  [ "$1" = 1 ] && need=$(( need + (N_ARMS - 1) * (now - $2 + per + BENCH_S + STOP_S) ))
  echo "   budget: ${need}s of ${BUDGET_S}s with the next load (~${per}s a load)"
  [ "$need" -le "$BUDGET_S" ]
}
flood_keys() {  # the flood-key arguments of the first N flooding tenants
  local k args=""
  for k in "${FLOOD_KEYS[@]:0:$1}"; do args="$args --flood-key $k"; done
  echo "$args"
}
flood() {  # url arm key-args metrics-args lead arm-start: one flood per load, labelled arm-load
  # (key-args: the stack's quiet key; the flood keys follow the load's tenants)
  local load fin fout qin qout mode stream tenants keys label ran=0 first_load
  first_load=$(date +%s)
  for load in ${RUN_LOADS:-${LOADS:-1024/128/128/16}}; do
    if ! fits "$5" "$6" "$ran" "$first_load"; then
      echo "-- $2: load $load skipped: it would not end within BUDGET_S=$BUDGET_S for every arm"
      continue
    fi
    [ "$5" = 1 ] && RUN_LOADS="$RUN_LOADS $load"
    ran=$(( ran + 1 ))
    IFS=/ read -r fin fout qin qout mode <<< "$load"
    stream=${FLOOD_STREAM:-}; tenants=${FLOOD_TENANTS:-1}; label="$2-$fin-$fout-$qin-$qout"
    if [ -n "$mode" ]; then  # this load's own flood shape
      case ${mode:0:1} in s) stream=1 ;; u) stream="" ;; *) echo "load $load: mode $mode is not s|u + N"; continue ;; esac
      tenants=${mode:1}; tenants=${tenants:-${FLOOD_TENANTS:-1}}
      if ! [ "$tenants" -ge 1 ] 2>/dev/null || [ "$tenants" -gt "${#FLOOD_KEYS[@]}" ]; then
        echo "load $load: $tenants flooding tenants, FLOOD_TENANTS=${#FLOOD_KEYS[@]}"; continue
      fi
      label="$label-$mode"
    fi
    keys=""; [ -n "$3" ] && keys="$(flood_keys "$tenants") $3"
    echo "-- $label"
    $PY -m serve_app.cli flood --base-url "$1" --model "$MODEL" --flood-concurrency "$FLOOD_C" \
      --flood-in "$fin" --flood-out "$fout" --quiet-in "$qin" --quiet-out "$qout" \
      --duration-s "$DUR" --settle-s "${SETTLE_S:-10}" --token-range "${TOKEN_RANGE:-1000-20000}" \
      ${stream:+--flood-stream} --quiet-process \
      --label "$label" --out "$DIR/$label.json" $keys $4 2>&1 | tail -n 3 | tee "$DIR/$label.txt"
  done
}

LEAD=1
declare -A RUNS  # an arm named again (ARMS="stack stackpbp stackpbp stack"): its files say stack-run2
TAGS=()  # each arm's tag (its files' prefix), in ARMS order; BARE_TAG: the first bare arm's
BARE_TAG=""
for entry in ${ARMS:-bare stack}; do
  T0=$(date +%s)
  arm=${entry%%,*}  # bare, stack, stack2 or stackpbp; after a comma, this arm's engine arguments
  RUNS[$entry]=$(( ${RUNS[$entry]:-0} + 1 ))
  tag=$(tr ',=' '--' <<< "$entry"); [ "${RUNS[$entry]}" -gt 1 ] && tag="$tag-run${RUNS[$entry]}"
  TAGS+=("$tag"); [ "$arm" = bare ] && [ -z "$BARE_TAG" ] && BARE_TAG=$tag
  if [ "$arm" = bare ]; then ARM_CONFIG=$CONFIG; else ARM_CONFIG=$DIR/$arm-config.yaml; fi
  if [ "$entry" != "$arm" ]; then
    with_engine_args "$ARM_CONFIG" $(tr ',' ' ' <<< "${entry#*,}") > "$DIR/$tag-config.yaml" \
      || exit 1
    ARM_CONFIG=$DIR/$tag-config.yaml
  fi
  if [ "$arm" = bare ]; then
    BARE_CMD=$($PY -m serve_bench.arms "$ARM_CONFIG")
    echo "== $tag: $BARE_CMD --port 8100"
    require_free_port 8100 || exit 1
setsid bash -c "exec $BARE_CMD --port 8100" > "$DIR/$tag-server.log" 2>&1 &
    PID=$!
    wait_ready http://127.0.0.1:8100 $PID 420 none && \
      flood http://127.0.0.1:8100 "$tag" "" "--metrics-url http://127.0.0.1:8100/metrics" \
        "$LEAD" "$T0" && \
      arm_bench http://127.0.0.1:8100 "$tag"
  else  # stack, stack2 or stackpbp
    echo "== $tag: serve-app run --config $ARM_CONFIG"
    require_free_port 8000 || exit 1
setsid $PY -m serve_app.cli run --config "$ARM_CONFIG" --port 8000 \
      > "$DIR/$tag-server.log" 2>&1 &
    PID=$!
    wait_ready http://127.0.0.1:8000 $PID 420 "$QUIET_KEY" && \
      flood http://127.0.0.1:8000 "$tag" "--quiet-key $QUIET_KEY" "$(ray_metrics_urls)" \
        "$LEAD" "$T0" && \
      arm_bench http://127.0.0.1:8000 "$tag" "--tenant flood:${FLOOD_KEYS[0]}:1"
  fi
  stop $PID
  echo "$tag arm took $(( $(date +%s) - T0 ))s"
  # The later arms run what the first ran (none: it failed to start, so they run every load).
  LEAD=0; [ -n "$RUN_LOADS" ] || RUN_LOADS="${LOADS:-1024/128/128/16}"
done
cat "$DIR"/*-*-*.txt > "$DIR/summary.txt" 2>/dev/null
# each arm against bare vLLM on the same load: the flood's steady output and the engine's work
$PY -m serve_bench.flood_table "$DIR" >> "$DIR/summary.txt"
if [ -n "${ARM_BENCH:-}" ] && [ -f "$DIR/$BARE_TAG-bench/results.json" ]; then
  for tag in "${TAGS[@]}"; do  # ARM_BENCH: each other arm against the first bare arm's run
    [ "$tag" != "$BARE_TAG" ] && [ -f "$DIR/$tag-bench/results.json" ] \
      && $PY "$(dirname "$0")/compare_arms.py" "$DIR/$BARE_TAG-bench/results.json" \
        "$DIR/$tag-bench/results.json" --names "$BARE_TAG,$tag" --title "ARM_BENCH: $ARM_BENCH" \
        --md "$DIR/$tag-bench-compare.md" > /dev/null \
      && cat "$DIR/$tag-bench-compare.md" >> "$DIR/summary.txt"
  done
fi
cat "$DIR/summary.txt"
cp "$DIR/summary.txt" "$DIR.summary.txt" 2>/dev/null; pack_results "$DIR"
