#!/usr/bin/env bash
# Issue 40's overhead A/B: the stack with OpenTelemetry traces off against traces on at
# SAMPLE (0.1) of new traces, exporting over OTLP/HTTP to a receiver on this host
# (tests/integration/otlp_receiver.py, which decodes every export and counts the spans), one
# command on one GPU. The arms run one after the other in ARMS order ("off on off": the repeat
# of the first arm shows the host's drift between arms), each a fresh `serve-app run` of the
# same deployment with only `router.tracing` changed (the engine replicas learn it through
# their environment, so they restart too), warmed up and driven by the same `serve-app bench`
# load. An arm that would not finish before BUDGET_S (570) is skipped.
#
# usage: bench/gpu_tracing.sh IN_LEN OUT_LEN NUM_REQUESTS CONCURRENCY [CONFIG]
#   e.g. bench/gpu_tracing.sh 1024 128 512 256 deployments/gpu-1.yaml
#   env: ARMS="off on off", SAMPLE=0.1, BUDGET_S=570, ARM_S=190 (an arm's expected length)
# One summary file: $OUT/tracing.md (each "on" arm against the first "off" one, and the
# receiver's span counts); the arms' results under $OUT/tracing/.
# On the lent GPU host run it as `../shared/gpu/host.sh bench/gpu_tracing.sh ...`.
set -uo pipefail
. "$(dirname "$0")/arm_lib.sh"
IN=$1; OUTLEN=$2; NUM=$3; CONC=$4; CONFIG=${5:-deployments/gpu-1.yaml}
PY=${PYTHON:-python3}
DEST=${OUT:-bench/out}
DIR=$DEST/tracing
REPORT=$DEST/tracing.md
rm -rf "$DIR"; mkdir -p "$DIR"
T0=$(date +%s)
SAMPLE=${SAMPLE:-0.1}
ensure_model "$CONFIG"
MODEL=$($PY -c "from serve_app.config import load_config as l; print(l('$CONFIG').models[0].name)")

require_free_port 4318 || exit 1
$PY -m tests.integration.otlp_receiver --port 4318 --summary "$DIR/receiver.json" \
  > "$DIR/receiver.log" 2>&1 &
RECEIVER=$!

config_for() {  # off|on: the deployment with router.tracing off, or on at SAMPLE
  $PY - "$CONFIG" "$1" "$SAMPLE" > "$DIR/$1.yaml" <<'PY'
import sys
from pathlib import Path

import yaml

from serve_app.config import load_config

path, arm, sample = sys.argv[1:]
cfg = yaml.safe_load(Path(path).read_text())
cfg["models"][0]["path"] = str(load_config(path).models[0].path)  # as it was resolved
cfg.setdefault("router", {})["tracing"] = (
    {"enabled": True, "endpoint": "http://127.0.0.1:4318", "sample_ratio": float(sample)}
    if arm == "on" else {"enabled": False})
print(yaml.safe_dump(cfg, sort_keys=False))
PY
}

N=0
for arm in ${ARMS:-off on off}; do
  LEFT=$(( T0 + ${BUDGET_S:-570} - $(date +%s) ))
  [ "$LEFT" -ge "${ARM_S:-190}" ] || { echo "no time left for arm $N ($arm): ${LEFT}s"; break; }
  N=$((N + 1)); name="$N-$arm"
  config_for "$arm"
  echo "== arm $name (${LEFT}s left)"
  require_free_port 8000 || break
  setsid $PY -m serve_app.cli run --config "$DIR/$arm.yaml" --port 8000 \
    > "$DIR/$name-server.log" 2>&1 &
  STACK=$!
  if wait_ready http://127.0.0.1:8000 $STACK 300; then
    $PY -m serve_app.cli bench --base-url http://127.0.0.1:8000 --model "$MODEL" \
      --input-len "$IN" --output-len "$OUTLEN" --num-requests "$NUM" --concurrency "$CONC" \
      --token-range "${TOKEN_RANGE:-1000-20000}" --seed 100 --quiet --label "traces $arm" \
      --out "$DIR/$name" > "$DIR/$name.log" 2>&1
    grep -A4 "^## Runs" "$DIR/$name/summary.md" || tail -n 20 "$DIR/$name.log"
  fi
  stop $STACK
done
kill -TERM $RECEIVER; wait $RECEIVER
{
  echo "### Traces off against on at $SAMPLE sampling ($MODEL, ${IN} in / ${OUTLEN} out, c=$CONC)"
  echo
  echo "$(basename "$CONFIG"), arms in order: ${ARMS:-off on off}; each a fresh serve-app run."
  first_off=$(ls -d "$DIR"/*-off 2>/dev/null | head -n 1)
  for d in "$DIR"/*-*/; do
    d=${d%/}; [ "$d" = "$first_off" ] || [ ! -s "$d/results.json" ] && continue
    [ -n "$first_off" ] && $PY bench/compare_arms.py "$first_off/results.json" "$d/results.json" \
      --names "$(basename "$first_off"),$(basename "$d")" --title "$(basename "$d") against $(basename "$first_off")"
  done
  echo "Receiver (every span exported by the on arms): $(cat "$DIR/receiver.json" 2>/dev/null)"
  echo "took $(( $(date +%s) - T0 ))s"
} > "$REPORT"
cat "$REPORT"
