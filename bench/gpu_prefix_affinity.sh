#!/usr/bin/env bash
# Issue 31's A/B on one GPU: two engine replicas at UTIL (0.3) of its memory each, Serve's power
# of two choices against prefix affinity (routing.policy), on the same workloads, one command.
# Two Serve replicas on one GPU need two Ray nodes that share the device (as the node-loss test
# does): tests/integration/local_cluster.py with CLUSTER_GPUS=0,0; the router sits on the head.
# Workloads (WORKLOADS, each run under every policy of POLICIES):
#   shared  PREFIX_GROUPS prefix groups of PREFIX tokens over 4 equal tenants, a unique SUFFIX-token
#           suffix, OUTPUT tokens, CONC streams, NUM requests after one warm-up request per group
#           (64 x 4096 = 262k tokens: more than one replica's KV cache at 0.3, less than two)
#   random  random prompts of PREFIX+SUFFIX tokens, no shared prefix (no-regression check)
#   hot     the shared workload with one tenant sending 70% of the requests
#   chat    multi-turn chat (issue 38): CHAT_GROUPS (8) system prompts of CHAT_PREFIX (1024) tokens
#           over the 4 tenants, their popularity Zipf-skewed (SKEW 1.0), SESSIONS (64) sessions a
#           round of TURNS (6) turns, each turn the whole history (+ CHAT_SUFFIX 256 user tokens
#           and an OUTPUT-token answer), NUM_CHAT (384) requests after one warm-up per prompt
#   history the same with short system prompts and long turns (256-token prompts, 512-token
#           user turns, 256-token answers)
#           SESSION_SHUFFLE=SPAN (chat, history): each later pass over the sessions shuffled within
#           spans of SPAN places (serve-app bench --session-shuffle). Default SESSIONS - CONC (32):
#           every next turn still comes CONC + 1 requests or more after its last. 0 (as 38b ran):
#           every pass in one order, a lockstep that lets power of two keep sessions on one
#           replica by accident (RESULTS 38c)
# Each arm's row carries the workload's ceiling: the share of its prompt tokens a perfect router
# (unbounded caches) could find cached (serve_bench.shared_prefix.cached_ceiling), and under
# prefix_cache the error of the replicas' LRU records (predicted cached share against vLLM's).
# A policy change rolls the routers only (the engines and their caches stay), so each arm draws
# its prefixes with its own seed: no arm finds another's prefixes cached.
# Per arm: TTFT p50/p99 and output throughput (serve-app bench), prefix-cache hit rate and
# finished requests per replica (vLLM's counters through Ray's metrics agents, read after the
# warm-up and after the run), running requests per replica sampled every second.
# usage: bench/gpu_prefix_affinity.sh [CONFIG]   (env: PYTHON, OUT, UTIL=0.3, POLICIES (default
#   "power_of_two prefix_affinity"; issue 38: "power_of_two prefix_cache"; an entry
#   POLICY,KNOB=VALUE[,...] is that policy with routing knobs of its own, its arm labelled
#   POLICY-KNOB-VALUE: "power_of_two prefix_cache prefix_cache,request_cost_tokens=16" A/Bs a
#   knob in one call), MAX_BLOCKS and REQUEST_COST_TOKENS (prefix_cache's knobs, every arm),
#   WORKLOADS, PREFIX_GROUPS=64 PREFIX=4096 SUFFIX=256 OUTPUT=128 CONC=32 NUM=256, MARGIN (routing.
#   imbalance_margin), LOAD_FACTOR (routing.load_factor), PREFIX_BLOCKS, BLOCK_TOKENS (routing
#   key), TOKEN_RANGE, GPUS=0,0, CPUS=8, KV_BYTES (each engine's KV cache in bytes: two engines that
#   start together on one GPU size their caches from memory the other is still taking, 85k and
#   217k tokens at UTIL 0.3 in one call; a fixed size makes both arms' replicas equal),
#   BUDGET_S (the call's time: an arm starts only if the longest arm so far still ends within
#   it, with 20 s for the report; a skipped arm is named, and the report still comes. Unset: no
#   guard. On the lent host: BUDGET_S=570 inside host.sh's 585 s))
# One summary file: $OUT/prefix-affinity.md (the arms' files under $OUT/prefix-affinity/).
# A CPU dry run with tiny sizes: CONFIG=deployments/local-cpu.yaml GPUS= (two CPU nodes).
# On the lent GPU host run it as `../shared/gpu/host.sh bench/gpu_prefix_affinity.sh`; on your own
# GPU machine, with the project installed, run it directly. Results: bench/RESULTS.md 31, 31b.
set -uo pipefail
. "$(dirname "$0")/arm_lib.sh"
CONFIG=${1:-${CONFIG:-deployments/gpu-1.yaml}}
PY=${PYTHON:-python3}
DEST=${OUT:-bench/out}
DIR=$DEST/prefix-affinity
REPORT=$DEST/prefix-affinity.md
rm -rf "$DIR"; mkdir -p "$DIR"
T0=$(date +%s)
GROUPS_N=${PREFIX_GROUPS:-64}; PREFIX=${PREFIX:-4096}; SUFFIX=${SUFFIX:-256}; OUTPUT=${OUTPUT:-128}
CONC=${CONC:-32}; NUM=${NUM:-256}; PORT=${PORT:-8000}
SHUFFLE=${SESSION_SHUFFLE:-$(( ${SESSIONS:-64} > CONC ? ${SESSIONS:-64} - CONC : 0 ))}
ensure_model "$CONFIG"
MODEL=$($PY -c "from serve_app.config import load_config as l; print(l('$CONFIG').models[0].name)")
KEYS=()
for i in 0 1 2 3; do KEYS+=("$($PY -c "from serve_app.governance.keys import new_key; print(new_key())")"); done

# The deployment with two engine replicas at UTIL each (one per Ray node), the router on the head,
# four tenants (throwaway keys) and the policy given; written as DIR/LABEL.yaml.
config_for() {  # policy entry (POLICY[,KNOB=VALUE...]) and its label
  $PY - "$CONFIG" "$1" "${UTIL:-0.3}" "${KEYS[@]}" > "$DIR/$2.yaml" <<'PY'
import os, sys
from pathlib import Path

import yaml

from serve_app.config import load_config
from serve_app.governance.keys import key_digest

path, entry, util, *keys = sys.argv[1:]
policy, *own = entry.split(",")
cfg = yaml.safe_load(Path(path).read_text())
model = cfg["models"][0]
model["path"] = str(load_config(path).models[0].path)  # as it was resolved
model["autoscaling"] = {"min_replicas": 2, "max_replicas": 2}
if model.get("device", "gpu") == "gpu":
    model["engine_kwargs"]["gpu_memory_utilization"] = float(util)
    if os.environ.get("KV_BYTES"):  # both engines the same KV cache (see KV_BYTES above)
        model["engine_kwargs"]["kv_cache_memory_bytes"] = int(os.environ["KV_BYTES"])
routing = {"policy": policy}
knobs = {"imbalance_margin": "MARGIN", "block_tokens": "BLOCK_TOKENS",
         "load_factor": "LOAD_FACTOR"}
if policy == "prefix_affinity":
    knobs["prefix_blocks"] = "PREFIX_BLOCKS"
if policy == "prefix_cache":
    knobs.update(max_blocks="MAX_BLOCKS", request_cost_tokens="REQUEST_COST_TOKENS")
for knob, env in knobs.items():
    if os.environ.get(env):
        routing[knob] = (float if knob == "load_factor" else int)(os.environ[env])
for pair in own:  # this arm's own knobs (the label says which), over the env's
    knob, _, value = pair.partition("=")
    routing[knob] = yaml.safe_load(value)
model["routing"] = routing
cfg.setdefault("router", {}).update(host="127.0.0.1", resources={"head": 0.01})
cfg["tenants"] = [{"name": f"t{i}", "api_key_sha256": [key_digest(k)]} for i, k in enumerate(keys)]
print(yaml.safe_dump(cfg, sort_keys=False))
PY
}

wait_two() {  # until the app is RUNNING, every replica RUNNING and two of the engines (the
  # routers' views of the engines start with their first request: not a sign of readiness)
  for _ in $(seq 300); do
    $PY -m serve_app.cli status --address "$ADDRESS" 2>/dev/null | $PY -c "import json, sys; s = json.load(sys.stdin); sys.exit(0 if s['status'] == 'RUNNING' and all(set(d) == {'RUNNING'} and (not k.startswith('LLMServer') or d['RUNNING'] == 2) for k, d in s['deployments'].items()) else 1)" && return 0
    sleep 2
  done
  echo "the app did not reach two running engine replicas"; return 1
}

bench_args() {  # workload seed: the serve-app bench arguments of one arm
  local tenants="--tenant t0:${KEYS[0]}:1 --tenant t1:${KEYS[1]}:1 --tenant t2:${KEYS[2]}:1 --tenant t3:${KEYS[3]}:1"
  [ "$1" = hot ] && tenants="--tenant t0:${KEYS[0]}:0.7 --tenant t1:${KEYS[1]}:0.1 --tenant t2:${KEYS[2]}:0.1 --tenant t3:${KEYS[3]}:0.1"
  local shape="--prefix-groups $GROUPS_N --prefix-len $PREFIX --input-len $SUFFIX"
  [ "$1" = random ] && shape="--input-len $((PREFIX + SUFFIX)) --warmup $CONC"
  local sessions="--turns ${TURNS:-6} --sessions ${SESSIONS:-64} --prefix-skew ${SKEW:-1.0} \
--session-shuffle $SHUFFLE"
  [ "$1" = chat ] && shape="--prefix-groups $CHAT_GROUPS --prefix-len ${CHAT_PREFIX:-1024} \
--input-len ${CHAT_SUFFIX:-256} $sessions"
  [ "$1" = history ] && shape="--prefix-groups $CHAT_GROUPS --prefix-len 256 --input-len 512 \
--output-len 256 $sessions"
  echo "--base-url http://127.0.0.1:$PORT --model $MODEL --concurrency $CONC --output-len $OUTPUT \
--token-range ${TOKEN_RANGE:-1000-20000} --seed $2 --quiet $tenants $shape"
}

FINISHED=0  # requests the engines have finished since they started (every arm's, in order)
LONGEST=0  # the longest arm so far, in seconds (BUDGET_S)
fits() {  # may the next arm start within BUDGET_S? (the first always does)
  [ -n "${BUDGET_S:-}" ] && [ "$LONGEST" -gt 0 ] || return 0
  local need=$(( $(date +%s) - T0 + LONGEST + 20 ))
  echo "   budget: ${need}s of ${BUDGET_S}s with the next arm (the longest so far ${LONGEST}s)"
  [ "$need" -le "$BUDGET_S" ]
}
CHAT_GROUPS=${CHAT_GROUPS:-8}
arm() {  # workload policy seed
  local name="$1--$2" d="$DIR/$1--$2" warm=$GROUPS_N num=$NUM
  [ "$1" = random ] && warm=$CONC
  case "$1" in chat|history) warm=$CHAT_GROUPS; num=${NUM_CHAT:-384};; esac
  mkdir -p "$d"
  echo "-- $name"
  $PY -m serve_app.cli bench $(bench_args "$1" "$3") --warmup-only > "$d/warmup.log" 2>&1
  FINISHED=$((FINISHED + warm))
  $PY bench/prefix_affinity_report.py scrape "$d/before.json" --min-finished $FINISHED
  $PY bench/prefix_affinity_report.py record "$d/record-before.json" --address "$ADDRESS" \
    --model "$MODEL" 2>> "$d/sample.log"
  $PY bench/prefix_affinity_report.py sample "$d/load.jsonl" --address "$ADDRESS" 2> "$d/sample.log" &
  local sampler=$!
  $PY -m serve_app.cli bench $(bench_args "$1" "$3") --warmup 0 --num-requests "$num" \
    --label "$name" --out "$d" > "$d/bench.log" 2>&1
  kill -TERM $sampler; wait $sampler 2>/dev/null
  FINISHED=$((FINISHED + num))
  $PY bench/prefix_affinity_report.py scrape "$d/after.json" --min-finished $FINISHED
  $PY bench/prefix_affinity_report.py record "$d/record-after.json" --address "$ADDRESS" \
    --model "$MODEL" 2>> "$d/sample.log"
  grep -A4 "^## Runs" "$d/summary.md" 2>/dev/null || tail -n 5 "$d/bench.log"
}

start_cluster "$DIR" "${GPUS-0,0}" "${CPUS:-8}" || exit 1
require_free_port "$PORT" || exit 1
SEED=100
for entry in ${POLICIES:-power_of_two prefix_affinity}; do
  policy=$(echo "$entry" | tr ',=' '--')  # the arm's label
  config_for "$entry" "$policy"
  # The first deploy starts the engines; a policy change then rolls the routers only.
  $PY -m serve_app.cli deploy --config "$DIR/$policy.yaml" --address "$ADDRESS" --port "$PORT" \
    > "$DIR/deploy-$policy.log" 2>&1 || { tail -n 20 "$DIR/deploy-$policy.log"; exit 1; }
  wait_two || exit 1
  for workload in ${WORKLOADS:-shared random hot}; do
    if fits; then
      t_arm=$(date +%s)
      arm "$workload" "$policy" "$SEED"
      t_arm=$(( $(date +%s) - t_arm )); [ "$t_arm" -gt "$LONGEST" ] && LONGEST=$t_arm
    else
      echo "-- $workload--$policy skipped: it would not end within BUDGET_S=$BUDGET_S"
    fi
    SEED=$((SEED + 1))  # a skipped arm keeps the later arms' seeds
  done
  $PY -m serve_app.cli status --address "$ADDRESS" > "$DIR/status-$policy.json" 2>&1
done
# Each engine's KV-cache size: the hit rate on a working set larger than one cache moves with
# it (two calls of the same command differed a lot in the power-of-two arm; see RESULTS 31).
grep -h "KV cache size" /tmp/ray/session_latest/logs/*.err /tmp/ray/session_latest/logs/*.out \
  2>/dev/null | sort -u > "$DIR/kv-cache.txt"
{
  echo "### ${POLICIES:-power_of_two prefix_affinity} ($MODEL, two replicas on one device)"
  echo
  echo "$(basename "$CONFIG"), engines at ${UTIL:-0.3} of the GPU memory each${KV_BYTES:+, KV cache $KV_BYTES bytes each}; shared: $GROUPS_N groups x $PREFIX tokens over 4 tenants, suffix $SUFFIX, output $OUTPUT, c=$CONC, $NUM requests after one warm-up request per group; random: $((PREFIX + SUFFIX))-token random prompts; hot: shared with one tenant at 70%; chat: $CHAT_GROUPS system prompts x ${CHAT_PREFIX:-1024} tokens (skew ${SKEW:-1.0}), ${SESSIONS:-64} sessions x ${TURNS:-6} turns of ${CHAT_SUFFIX:-256} + $OUTPUT tokens, ${NUM_CHAT:-384} requests, passes shuffled in spans of $SHUFFLE (0: none); history: the same with 256-token system prompts, 512-token turns, 256-token answers."
  echo
  $PY bench/prefix_affinity_report.py table "$DIR"
  echo; echo "Engines' KV caches:"; sed 's/^/    /' "$DIR/kv-cache.txt"
  echo "took $(( $(date +%s) - T0 ))s"
} > "$REPORT"
cat "$REPORT"
