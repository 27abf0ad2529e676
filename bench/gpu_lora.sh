#!/usr/bin/env bash
# Issue 39's two GPU measurements of tenant-owned LoRA adapters, one command each (PARTS):
#   mix       one engine replica (the config as it is): eight tenants t0..t7 with Zipf-skewed
#             shares (1/(i+1)), IN-token random prompts, OUTPUT tokens, each concurrency of CONC
#             (NUM requests each, after the bench's warm-up). Arm `base`: the base model alone,
#             LoRA off, every tenant sends to it. Arm `lora`: LoRA on (lora.max_loras 8,
#             max_lora_rank RANK) and eight rank-RANK adapters a0..a7, a<i> owned by t<i>, which
#             sends to it (`--tenant name:key:share:model`). Same seed, prompts and load; each arm
#             a fresh `serve-app run`, in MIX_ARMS order ("base lora"). The cost of serving
#             adapters: output throughput lora / base, TTFT p50/p99, TPOT p50.
#   affinity  two engine replicas on one GPU (two Ray nodes sharing the device, as
#             bench/gpu_prefix_affinity.sh: tests/integration/local_cluster.py with
#             CLUSTER_GPUS=0,0; the router on the head), UTIL (0.42) of the memory each, KV_BYTES
#             (equal KV caches), the eight adapters on AFF_MAX_LORAS (4) slots per replica (fewer
#             than adapters, so placement matters; max_cpu_loras the same); the mix's lora
#             workload at AFF_CONC (256), AFF_NUM (768) requests. Arms in POLICIES order
#             ("power_of_two prefix_cache prefix_cache power_of_two"): power_of_two (Serve's
#             choice with routing.adapter_replicas 0, no adapter placement: the baseline) against
#             prefix_cache (adapter placement on, routing.adapter_replicas ADAPTER_REPLICAS,
#             default 2). A policy change rolls the
#             routers only: the engines keep the adapters they hold, so each arm starts with the
#             bench's warm-up (AFF_CONC requests of the same mix) under its own policy, and draws
#             its prompts with its own seed (no arm finds another's prompts cached). Per arm:
#             TTFT p50/p99, output tok/s, TPOT p50, adapter loads and evictions per replica
#             (ray_serve_app_adapter_swaps_total by event, through Ray's metrics agents, after
#             the warm-up and after the run), requests finished per replica (vLLM's counters),
#             the adapters each replica holds at the end (serve-app status).
# The adapters (serve-app make-adapter, random weights, q_proj and v_proj, seeds 1..8) are
# written once next to the model folder: <model path>-adapters/a0..a7.
# usage: bench/gpu_lora.sh [CONFIG]   (env: PARTS="mix affinity", PYTHON, OUT, IN=1024 OUTPUT=128
#   CONC=64,256 NUM=256,512 (mix: one or one per concurrency), RANK=16, MIX_ARMS="base lora",
#   AFF_CONC=256 AFF_NUM=768, AFF_MAX_LORAS=4, ADAPTER_REPLICAS, UTIL=0.42, KV_BYTES (each
#   engine's KV cache in bytes, affinity part), POLICIES, TOKEN_RANGE=1000-20000, GPUS=0,0,
#   CPUS=8, PORT=8000, BUDGET_S=570 (an arm that would not end before it is skipped: MIX_ARM_S=200
#   a mix arm, AFF_ARM_S=80 an affinity arm, AFF_START_S=150 the cluster and its two engines))
# On the GPU run one part per call (each fits one call's ~570 s; both do not), e.g. on an H200:
#   PARTS=mix bench/gpu_lora.sh deployments/gpu-1.yaml
#   PARTS=affinity KV_BYTES=27500000000 bench/gpu_lora.sh deployments/gpu-1.yaml
# (27.5 GB of KV cache each, as bench/RESULTS.md 31b: ~210k tokens, more than c=256 of 1,152-token
# requests needs on either replica; two such engines do not fit an 80 GB card: there ~10 GB).
# One summary file: $OUT/lora.md (each part's files under $OUT/lora/mix/ and $OUT/lora/affinity/).
# A CPU dry run with tiny sizes: CONFIG=deployments/local-cpu.yaml GPUS= (the tiny model; two CPU
#   nodes for the affinity part), e.g. IN=64 OUTPUT=16 CONC=8 NUM=40 AFF_CONC=8 AFF_NUM=40
#   RANK=16 TOKEN_RANGE=10-500 MIX_ARM_S=60 AFF_ARM_S=30 AFF_START_S=60 CPUS=4 (about 7 minutes
#   on two cores).
# On the lent GPU host run it as `../shared/gpu/host.sh bench/gpu_lora.sh`; on your own GPU
# machine, with the project installed, run it directly. Results: bench/RESULTS.md 39b.
set -uo pipefail
. "$(dirname "$0")/arm_lib.sh"
CONFIG=${1:-${CONFIG:-deployments/gpu-1.yaml}}
PY=${PYTHON:-python3}
DEST=${OUT:-bench/out}
REPORT=$DEST/lora.md
PARTS=${PARTS:-mix affinity}
T0=$(date +%s)
BUDGET=${BUDGET_S:-570}
IN=${IN:-1024}; OUTPUT=${OUTPUT:-128}; CONC=${CONC:-64,256}; NUM=${NUM:-256,512}
RANK=${RANK:-16}; PORT=${PORT:-8000}; N_ADAPTERS=8
AFF_CONC=${AFF_CONC:-256}; AFF_NUM=${AFF_NUM:-768}
left() { echo $(( T0 + BUDGET - $(date +%s) )); }
mkdir -p "$DEST/lora"
ensure_model "$CONFIG"
read -r MODEL MPATH DEVICE < <($PY -c "from serve_app.config import load_config as l; m = l('$CONFIG').models[0]; print(m.name, m.path, m.device)")
ADAPTERS=${MPATH%/}-adapters
for i in $(seq 0 $((N_ADAPTERS - 1))); do
  $PY -m serve_app.cli make-adapter --base "$MPATH" --out "$ADAPTERS/a$i" --seed $((i + 1)) \
    --rank "$RANK" > /dev/null || exit 1
done
KEYS=(); SHARES=()
for i in $(seq 0 $((N_ADAPTERS - 1))); do
  KEYS+=("$($PY -c "from serve_app.governance.keys import new_key; print(new_key())")")
  SHARES+=("$(awk -v i="$i" 'BEGIN { printf "%.4f", 1 / (i + 1) }')")
done

# The deployment of one arm, written as $2/$1.yaml: ARM is base or lora (part mix: the config's
# one replica) or a routing policy (part affinity: two replicas at UTIL, the router on the head).
config_for() {  # arm dir
  $PY - "$CONFIG" "$1" "$ADAPTERS" "$RANK" "${KEYS[@]}" > "$2/$1.yaml" <<'PY'
import os, sys
from pathlib import Path

import yaml

from serve_app.config import load_config
from serve_app.governance.keys import key_digest

path, arm, adapters, rank, *keys = sys.argv[1:]
cfg = yaml.safe_load(Path(path).read_text())
model = cfg["models"][0]
model["path"] = str(load_config(path).models[0].path)  # as it was resolved
tenants = [f"t{i}" for i in range(len(keys))]
if arm != "base":  # LoRA on, one adapter per tenant
    slots = len(keys) if arm == "lora" else int(os.environ.get("AFF_MAX_LORAS", "4"))
    model["lora"] = {"max_loras": slots, "max_lora_rank": int(rank)}
    model["adapters"] = [{"name": f"a{i}", "path": str(Path(adapters).resolve() / f"a{i}"),
                          "owners": [t]} for i, t in enumerate(tenants)]
if arm not in ("base", "lora"):  # part affinity: the routing policy ARM on two replicas
    model["autoscaling"] = {"min_replicas": 2, "max_replicas": 2}
    if model.get("device", "gpu") == "gpu":
        model["engine_kwargs"]["gpu_memory_utilization"] = float(os.environ.get("UTIL", "0.42"))
        if os.environ.get("KV_BYTES"):  # both engines the same KV cache
            model["engine_kwargs"]["kv_cache_memory_bytes"] = int(os.environ["KV_BYTES"])
    routing = {"policy": arm}
    if arm == "power_of_two":  # the baseline: adapters spread like any request
        routing["adapter_replicas"] = 0
    elif os.environ.get("ADAPTER_REPLICAS"):
        routing["adapter_replicas"] = int(os.environ["ADAPTER_REPLICAS"])
    model["routing"] = routing
    cfg.setdefault("router", {})["resources"] = {"head": 0.01}
cfg.setdefault("router", {})["host"] = "127.0.0.1"
cfg["tenants"] = [{"name": t, "api_key_sha256": [key_digest(k)]} for t, k in zip(tenants, keys)]
print(yaml.safe_dump(cfg, sort_keys=False))
PY
}

tenant_args() {  # base|lora: the eight tenants, each sending to the base model or its adapter
  local i out=""
  for i in $(seq 0 $((N_ADAPTERS - 1))); do
    out+=" --tenant t$i:${KEYS[$i]}:${SHARES[$i]}"
    [ "$1" = lora ] && out+=":a$i"
  done
  echo "$out"
}

# Part mix: a fresh `serve-app run` per arm (as bench/gpu_tracing.sh), the same load on each.
part_mix() {
  local dir=$DEST/lora/mix arm stack n=0
  rm -rf "$dir"; mkdir -p "$dir"
  for arm in ${MIX_ARMS:-base lora}; do
    [ "$(left)" -ge "${MIX_ARM_S:-200}" ] || { echo "no time left for mix arm $arm: $(left)s"; break; }
    n=$((n + 1))
    config_for "$arm" "$dir"
    echo "== mix arm $n: $arm ($(left)s left)"
    require_free_port "$PORT" || break
    setsid $PY -m serve_app.cli run --config "$dir/$arm.yaml" --port "$PORT" \
      > "$dir/$arm-server.log" 2>&1 &
    stack=$!
    if wait_ready "http://127.0.0.1:$PORT" $stack "${START_S:-400}" "${KEYS[0]}"; then
      $PY -m serve_app.cli bench --base-url "http://127.0.0.1:$PORT" --model "$MODEL" \
        --input-len "$IN" --output-len "$OUTPUT" --num-requests "$NUM" --concurrency "$CONC" \
        --token-range "${TOKEN_RANGE:-1000-20000}" --seed 100 --quiet $(tenant_args "$arm") \
        --label "mix $arm" --out "$dir/$arm" > "$dir/$arm.log" 2>&1
      grep -A4 "^## Runs" "$dir/$arm/summary.md" 2>/dev/null || tail -n 20 "$dir/$arm.log"
    else
      tail -n 20 "$dir/$arm-server.log"
    fi
    stop $stack
  done
  {
    echo "### mix: 8 adapters (rank $RANK) against the base model alone ($MODEL, one replica)"
    echo
    echo "$(basename "$CONFIG"); 8 tenants, shares 1/(i+1) (${SHARES[*]}); ${IN} in / ${OUTPUT} out, c=$CONC, $NUM requests after the bench's warm-up (c requests); seed 100 in both arms; arms in order: ${MIX_ARMS:-base lora}, each a fresh serve-app run; base: LoRA off, every tenant on $MODEL; lora: lora.max_loras 8, max_lora_rank $RANK, tenant t<i> on adapter a<i>."
    echo
    $PY bench/lora_report.py mix "$dir"
    echo
  } >> "$REPORT"
}

wait_two() {  # the app RUNNING, every replica RUNNING and two of the engines
  for _ in $(seq 300); do
    $PY -m serve_app.cli status --address "$ADDRESS" 2>/dev/null | $PY -c "import json, sys; s = json.load(sys.stdin); sys.exit(0 if s['status'] == 'RUNNING' and all(set(d) == {'RUNNING'} and (not k.startswith('LLMServer') or d['RUNNING'] == 2) for k, d in s['deployments'].items()) else 1)" && return 0
    sleep 2
  done
  echo "the app did not reach two running engine replicas"; return 1
}

# Part affinity: one cluster of two nodes on the device, one deploy per policy (the first starts
# the engines, the next roll the routers only).
part_affinity() {
  local dir=$DEST/lora/affinity policy n=0 seed=200 finished=0 d args
  rm -rf "$dir"; mkdir -p "$dir"
  [ "$(left)" -ge "$(( ${AFF_START_S:-150} + ${AFF_ARM_S:-80} ))" ] || {
    echo "no time left for the affinity part: $(left)s"; return 0; }
  start_cluster "$dir" "${GPUS-0,0}" "${CPUS:-8}" || return 1
  # The cluster's own metrics targets (not whichever Ray started last on this machine).
  local session
  session=$($PY -c "import ray; ray.init(address='$ADDRESS', log_to_driver=False); print(ray._private.worker._global_node.get_session_dir_path())" 2> "$dir/session.log" | tail -n 1)
  [ -d "$session" ] || session=$(readlink -f /tmp/ray/session_latest)
  local sd=$session/prom_metrics_service_discovery.json
  echo "cluster at $ADDRESS, session $session"
  require_free_port "$PORT" || return 1
  for policy in ${POLICIES:-power_of_two prefix_cache prefix_cache power_of_two}; do
    [ "$(left)" -ge "${AFF_ARM_S:-80}" ] || { echo "no time left for arm $policy: $(left)s"; break; }
    n=$((n + 1)); d=$dir/$n-$policy; mkdir -p "$d"
    config_for "$policy" "$dir"
    echo "== affinity arm $n: $policy ($(left)s left)"
    $PY -m serve_app.cli deploy --config "$dir/$policy.yaml" --address "$ADDRESS" --port "$PORT" \
      > "$d/deploy.log" 2>&1 || { tail -n 20 "$d/deploy.log"; return 1; }
    wait_two || return 1
    args="--base-url http://127.0.0.1:$PORT --model $MODEL --input-len $IN --output-len $OUTPUT \
--concurrency $AFF_CONC --token-range ${TOKEN_RANGE:-1000-20000} --seed $seed --quiet \
$(tenant_args lora)"
    $PY -m serve_app.cli bench $args --warmup-only > "$d/warmup.log" 2>&1
    finished=$((finished + (AFF_CONC > 2 ? AFF_CONC : 2)))
    $PY bench/prefix_affinity_report.py scrape "$d/before.json" --sd "$sd" \
      --min-finished $finished 2>> "$d/scrape.log"
    $PY bench/lora_report.py swaps "$d/swaps-before.json" --sd "$sd" 2>> "$d/scrape.log"
    $PY -m serve_app.cli bench $args --warmup 0 --num-requests "$AFF_NUM" \
      --label "affinity $policy" --out "$d" > "$d/bench.log" 2>&1
    finished=$((finished + AFF_NUM))
    $PY bench/prefix_affinity_report.py scrape "$d/after.json" --sd "$sd" \
      --min-finished $finished 2>> "$d/scrape.log"
    $PY bench/lora_report.py swaps "$d/swaps-after.json" --sd "$sd" 2>> "$d/scrape.log"
    $PY -m serve_app.cli status --address "$ADDRESS" > "$d/status.json" 2> "$d/status.log"
    grep -A4 "^## Runs" "$d/summary.md" 2>/dev/null || tail -n 5 "$d/bench.log"
    seed=$((seed + 1))
  done
  grep -h "KV cache size" "$session"/logs/*.err "$session"/logs/*.out 2>/dev/null | sort -u \
    > "$dir/kv-cache.txt"
  {
    echo "### affinity: adapter placement (prefix_cache) against power_of_two ($MODEL, two replicas on one device)"
    echo
    local memory="engines on CPU"
    [ "$DEVICE" = gpu ] && memory="engines at ${UTIL:-0.42} of the GPU memory each${KV_BYTES:+, KV cache $KV_BYTES bytes each}"
    echo "$(basename "$CONFIG"), $memory; 8 rank-$RANK adapters on ${AFF_MAX_LORAS:-4} LoRA slots per replica (max_cpu_loras the same), adapter_replicas ${ADAPTER_REPLICAS:-2 (default)}; the mix's lora workload (8 tenants, shares 1/(i+1), t<i> on a<i>): ${IN} in / ${OUTPUT} out, c=$AFF_CONC, $AFF_NUM requests after a warm-up of $AFF_CONC under the arm's policy; arms in order: ${POLICIES:-power_of_two prefix_cache prefix_cache power_of_two} (a policy change rolls the routers; the engines and the adapters they hold stay); each arm its own prompt seed (from 200). Loads / evictions and requests per replica: counter deltas over the measured run, replicas in the same (id) order."
    echo
    $PY bench/lora_report.py affinity "$dir"
    echo; echo "Engines' KV caches:"; sed 's/^/    /' "$dir/kv-cache.txt"
    echo
  } >> "$REPORT"
}

{
  echo "## Issue 39: LoRA adapters on $MODEL ($(date -u +%Y-%m-%dT%H:%MZ))"
  echo
} > "$REPORT"
for part in $PARTS; do
  P0=$(date +%s)
  case $part in
    mix) part_mix ;;
    affinity) part_affinity; stop_cluster ;;
    *) echo "unknown part $part (mix, affinity)"; exit 2 ;;
  esac
  echo "part $part took $(( $(date +%s) - P0 ))s" >> "$REPORT"
  echo >> "$REPORT"
done
echo "took $(( $(date +%s) - T0 ))s" >> "$REPORT"
cat "$REPORT"
pack_results "$DEST/lora"
