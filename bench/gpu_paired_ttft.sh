#!/usr/bin/env bash
# TTFT at c=1, bare vLLM against the stack, measured in pairs (bench/paired_ttft.py): both
# servers run at once on one GPU, each with UTIL of its memory, and every prompt goes to one and
# then the other, one request in flight at a time. Separate runs carried the machine's drift into
# the comparison (bare vLLM's own c=1 TTFT p50 moved 7 ms between two runs, the gap to measure
# is 2 ms); a pair shares its moment.
#
# With LOAD, the same two servers first take a throughput load each, one after the other
# (`serve-app bench`, bare vLLM first): output throughput, TPOT and ITL of both arms from one
# moment and one command, without a second start of either server. Each server then has UTIL
# of the GPU's memory, so its KV cache is smaller than a server alone would get: compare the
# arms with each other, not with runs of a whole GPU.
#
# usage: bench/gpu_paired_ttft.sh "IN/OUT/PAIRS ..." [CONFIG]   e.g. "1024/128/64 128/1024/32"
#   env: UTIL=0.42 (each server's share of GPU memory), WARMUP=4, GAP_MS=50, BUDGET_S=540 (a shape
#   starts no new pair once the command has run this long, less the time to stop the servers)
#   LOAD="IN/OUT/NUMS/CONCS ..." e.g. "128/1024/128,256/64,256" (requests per concurrency level,
#   the levels); PROFILE_S=0 (>0: then the stack runs the last level again for that long plus
#   8 s, under py-spy on its LLMServer and router replicas; summaries in the load table);
#   GOVERNANCE=1: the stack serves two tenants with every governance path on (requests and
#   tokens per minute, a token budget, a concurrency cap, usage records under $OUT/usage), set
#   far above the load so that they cost what they cost without refusing anything; every
#   request of both arms carries one of their keys (bare vLLM ignores it), and the stack's
#   readiness is waited for with a key (/v1/models answers 401 without one)
# The servers start once; the loads run, then the shapes one after the other. $OUT gets per load
# load-IN-OUT.md (both arms' tables and their ratios) and per shape
# paired-IN-OUT.md (the table) and paired-IN-OUT-pairs.csv (one row per pair); the tarball of
# the logs holds paired-IN-OUT.json (every request) and the loads' results.
# On the lent GPU host run it as `../shared/gpu/host.sh bench/gpu_paired_ttft.sh ...` (frees the GPU
# and ports an earlier command left, sets the bundle's environment); on your own GPU machine,
# with the project installed, run it directly (`make bench-ttft`).
set -uo pipefail
. "$(dirname "$0")/arm_lib.sh"
SHAPES=$1; CONFIG=${2:-deployments/gpu-1.yaml}
PY=${PYTHON:-python3}
DEST=${OUT:-bench/out}
WORK=${WORK:-${TMPDIR:-/tmp}/gpu-paired}
DIR=$WORK/paired
rm -rf "$DIR"
mkdir -p "$DIR" "$DEST"
UTIL=${UTIL:-0.42}
TENANT_ARGS=(); STACK_KEY=""; PAIR_KEY=()
if [ "${GOVERNANCE:-0}" = 1 ]; then
  KEY_A=$($PY -c "from serve_app.governance.keys import new_key; print(new_key())")
  KEY_B=$($PY -c "from serve_app.governance.keys import new_key; print(new_key())")
  export KEY_A KEY_B USAGE_DIR="$DEST/usage" GOVERNANCE
  mkdir -p "$USAGE_DIR"
  TENANT_ARGS=(--tenant "gov-a:$KEY_A:1" --tenant "gov-b:$KEY_B:1")
  STACK_KEY=$KEY_A; PAIR_KEY=(--api-key "$KEY_A")
fi

# One config for both servers: the deployment's, with a share of the GPU and Server-Timing on
# (the stack's side of the table shows where its time went).
$PY - "$CONFIG" "$UTIL" > "$DIR/paired.yaml" <<'PY'
import os
import sys
from pathlib import Path

import yaml

from serve_app.config import load_config

path, util = sys.argv[1:3]
cfg = yaml.safe_load(Path(path).read_text())
model = cfg["models"][0]
model["path"] = load_config(path).models[0].path
if model.get("device", "cpu") == "gpu":
    model.setdefault("engine_kwargs", {})["gpu_memory_utilization"] = float(util)
cfg.setdefault("router", {})["server_timing"] = True
if os.environ.get("GOVERNANCE") == "1":
    from serve_app.governance.keys import key_digest

    limits = {"requests_per_minute": 10**7, "tokens_per_minute": 10**10,
              "max_concurrent_requests": 4096,
              "token_budget": {"tokens": 10**13, "period": "day"}}
    cfg["tenants"] = [{"name": name, "api_key_sha256": [key_digest(key)], **limits}
                      for name, key in (("gov-a", os.environ["KEY_A"]),
                                        ("gov-b", os.environ["KEY_B"]))]
    cfg.setdefault("governance", {})["usage"] = {"dir": os.environ["USAGE_DIR"]}
print(yaml.safe_dump(cfg, sort_keys=False))
PY
MODEL=$($PY -c "from serve_app.config import load_config as l; print(l('$DIR/paired.yaml').models[0].name)")
ensure_model "$DIR/paired.yaml"

require_free_port 8100 && require_free_port 8000 || exit 1
BARE_CMD=$($PY -m serve_bench.arms "$DIR/paired.yaml")
echo "== bare vLLM: $BARE_CMD --port 8100"
T0=$(date +%s)
setsid bash -c "exec $BARE_CMD --port 8100" > "$DIR/bare-server.log" 2>&1 &
BARE=$!
STACK=""
finish() {
  [ -n "$STACK" ] && stop "$STACK"
  stop "$BARE"
  tar -C "$WORK" -czf "$DEST/paired-logs.tgz" paired
}
# The stack starts once bare vLLM holds its memory: vLLM sizes its KV cache from what it finds.
if ! wait_ready http://127.0.0.1:8100 "$BARE" 420; then finish; exit 1; fi
echo "bare ready after $(( $(date +%s) - T0 ))s"
echo "== stack: serve-app run --config $DIR/paired.yaml --port 8000"
setsid $PY -m serve_app.cli run --config "$DIR/paired.yaml" --port 8000 \
  > "$DIR/stack-server.log" 2>&1 &
STACK=$!
if ! wait_ready http://127.0.0.1:8000 "$STACK" 420 "$STACK_KEY"; then finish; exit 1; fi
echo "both ready after $(( $(date +%s) - T0 ))s"
DEADLINE=$(( T0 + ${BUDGET_S:-540} - 45 ))
for load in ${LOAD:-}; do
  IFS=/ read -r IN OUTLEN NUMS CONCS <<< "$load"
  for arm in bare stack; do
    url=http://127.0.0.1:8100; [ "$arm" = stack ] && url=http://127.0.0.1:8000
    $PY -m serve_app.cli bench --base-url "$url" --model "$MODEL" --input-len "$IN" \
      --output-len "$OUTLEN" --num-requests "$NUMS" --concurrency "$CONCS" --warmup 2 \
      --token-range "${TOKEN_RANGE:-1000-20000}" --quiet --label "$arm ${IN}/${OUTLEN}" \
      --seed 100 --out "$DIR/load-$IN-$OUTLEN-$arm" "${TENANT_ARGS[@]}" \
      > "$DIR/load-$IN-$OUTLEN-$arm.log" 2>&1
  done
  if [ "${PROFILE_S:-0}" -gt 0 ]; then
    # The stack at the last (busiest) level once more (prompts of their own: the pairs' and the
    # loads' seeds differ, so no prompt is in a prefix cache), under py-spy once it has filled up.
    C=${CONCS##*,}
    $PY -m serve_app.cli bench --base-url http://127.0.0.1:8000 --model "$MODEL" \
      --input-len "$IN" --output-len "$OUTLEN" --num-requests $((C * 4)) --concurrency "$C" \
      --duration $((PROFILE_S + 8)) --warmup 0 --seed 7 --quiet --label profile \
      --out "$DIR/load-$IN-$OUTLEN-profile" > "$DIR/load-$IN-$OUTLEN-profile.log" 2>&1 &
    BENCH=$!
    sleep 6
    pyspy_parts "$DIR" "load-$IN-$OUTLEN" "$PROFILE_S" LLMServer Router
    wait $BENCH "${PYSPY_PIDS[@]}"
  fi
  {
    $PY bench/compare_arms.py "$DIR/load-$IN-$OUTLEN-bare/results.json" \
      "$DIR/load-$IN-$OUTLEN-stack/results.json" \
      --title "$MODEL, ${IN} in / ${OUTLEN} out, each server with ${UTIL} of the GPU's memory"
    pyspy_summaries "$DIR" "load-$IN-$OUTLEN" "stack, c=${CONCS##*,} ${IN}/${OUTLEN}" \
      LLMServer Router
    cat "$DIR"/load-$IN-$OUTLEN-*.profile.md 2>/dev/null
  } > "$DEST/load-$IN-$OUTLEN.md"
  cat "$DEST/load-$IN-$OUTLEN.md"
done
for shape in $SHAPES; do
  IFS=/ read -r IN OUTLEN PAIRS <<< "$shape"
  LEFT=$(( DEADLINE - $(date +%s) ))
  [ "$LEFT" -gt 10 ] || { echo "no time left for $shape"; break; }
  echo "== $shape (at most ${LEFT}s)"
  $PY bench/paired_ttft.py --a http://127.0.0.1:8100 --b http://127.0.0.1:8000 \
    --model "$MODEL" --input-len "$IN" --output-len "$OUTLEN" --num "$PAIRS" \
    --warmup "${WARMUP:-4}" --gap-ms "${GAP_MS:-50}" --a-metrics http://127.0.0.1:8100/metrics \
    --max-seconds "$LEFT" --token-range "${TOKEN_RANGE:-1000-20000}" \
    --out "$DIR/paired-${IN}-${OUTLEN}.json" "${PAIR_KEY[@]}" \
    --pairs-csv "$DEST/paired-${IN}-${OUTLEN}-pairs.csv" | tee "$DEST/paired-${IN}-${OUTLEN}.md"
done
finish
echo "took $(( $(date +%s) - T0 ))s"
