#!/usr/bin/env bash
# Stream smoothness on one GPU, in one command: bare `vllm serve`, the stack with its output
# channels (the default), and the stack with `router.output_channels: false` (one Serve message
# per token chunk: the path before the channels), same engine arguments, same `serve-app bench`
# load. Each stack arm also runs PROFILE_C streams for PROFILE_S seconds under py-spy (the
# LLMServer replica and the router). Everything lands in $OUT/stream-IN-OUT, plus one summary
# file and one tarball there (the device tool returns a limited number of files).
#
# usage: bench/gpu_stream.sh IN_LEN OUT_LEN NUM_REQUESTS [CONCURRENCY] [CONFIG] [EXTRA_BENCH_ARGS...]
#   env: ARMS="bare channels per-chunk", PROFILE_C=256, PROFILE_S=12 (0: no profile)
set -uo pipefail
. "$(dirname "$0")/arm_lib.sh"
IN=$1; OUTLEN=$2; NUM=$3; CONC=${4:-1,64,256}; CONFIG=${5:-deployments/gpu-1.yaml}
shift $(( $# < 5 ? $# : 5 ))
EXTRA=("$@")
PY=${PYTHON:-python3}
DEST=${OUT:-bench/out}
DIR=$DEST/stream-${IN}-${OUTLEN}
mkdir -p "$DIR"
PROFILE_C=${PROFILE_C:-256}; PROFILE_S=${PROFILE_S:-12}
MODEL=$($PY -c "from serve_app.config import load_config as l; print(l('$CONFIG').models[0].name)")
MPATH=$($PY -c "from serve_app.config import load_config as l; print(l('$CONFIG').models[0].path)")
[ -e "$MPATH" ] || $PY -m serve_app.cli make-model "${SHAPE:-llama-3.1-8b}" --out "$MPATH"

# The two stack configs: the deployment as it is, and with the output channels off.
for arm in channels per-chunk; do
  $PY - "$CONFIG" "$arm" > "$DIR/$arm.yaml" <<'PY'
import sys
from pathlib import Path

import yaml

from serve_app.config import load_config

path, arm = sys.argv[1:3]
cfg = yaml.safe_load(Path(path).read_text())
cfg["models"][0]["path"] = load_config(path).models[0].path
cfg.setdefault("router", {})["output_channels"] = arm == "channels"
print(yaml.safe_dump(cfg, sort_keys=False))
PY
done

bench() {  # url arm
  $PY -m serve_app.cli bench --base-url "$1" --model "$MODEL" --input-len "$IN" \
    --output-len "$OUTLEN" --num-requests "$NUM" --concurrency "$CONC" \
    --token-range "${TOKEN_RANGE:-1000-20000}" --quiet --label "$2 ${IN}/${OUTLEN}" \
    --out "$DIR/$2" "${EXTRA[@]}" > "$DIR/$2.log" 2>&1
  grep -A6 "^## Runs" "$DIR/$2/summary.md" || tail -n 20 "$DIR/$2.log"
}
profile() {  # url arm: PROFILE_C streams for a while, py-spy on the replica and the router
  [ "$PROFILE_S" -gt 0 ] || return 0
  $PY -m serve_app.cli bench --base-url "$1" --model "$MODEL" --input-len "$IN" \
    --output-len "$OUTLEN" --num-requests $((PROFILE_C * 4)) --concurrency "$PROFILE_C" \
    --duration $((PROFILE_S + 8)) --warmup 0 --quiet --label "profile" --out "$DIR/$2-profile" \
    > "$DIR/$2-profile.log" 2>&1 &
  local load=$!
  sleep 6
  for part in LLMServer Router; do
    local pid
    pid=$(pgrep -f "ServeReplica:.*:${part}" | head -n 1)
    [ -n "$pid" ] || { echo "no $part process"; continue; }
    py-spy record --nonblocking -p "$pid" -d "$PROFILE_S" -r 200 -f raw \
      -o "$DIR/$2-$part.pyspy.txt" > "$DIR/$2-$part.pyspy.log" 2>&1 &
  done
  wait
  for part in LLMServer Router; do
    [ -s "$DIR/$2-$part.pyspy.txt" ] && $PY bench/profile_summary.py "$DIR/$2-$part.pyspy.txt" \
      --title "$2 arm, $part replica, ${PROFILE_C} streams ${IN}/${OUTLEN}" --top 20 \
      > "$DIR/$2-$part.profile.md"
  done
}

for arm in ${ARMS:-bare channels per-chunk}; do
  T0=$(date +%s)
  if [ "$arm" = bare ]; then
    BARE_CMD=$($PY -m serve_app.bench.arms "$CONFIG")
    echo "== bare vLLM: $BARE_CMD --port 8100"
    require_free_port 8100 || exit 1
    setsid bash -c "exec $BARE_CMD --port 8100" > "$DIR/bare-server.log" 2>&1 &
    PID=$!
    wait_ready http://127.0.0.1:8100 $PID 420 && bench http://127.0.0.1:8100 bare
  else
    echo "== stack ($arm): serve-app run --config $DIR/$arm.yaml"
    require_free_port 8000 || exit 1
    setsid $PY -m serve_app.cli run --config "$DIR/$arm.yaml" --port 8000 \
      > "$DIR/$arm-server.log" 2>&1 &
    PID=$!
    wait_ready http://127.0.0.1:8000 $PID 420 && bench http://127.0.0.1:8000 "$arm" && \
      profile http://127.0.0.1:8000 "$arm"
  fi
  stop $PID
  echo "$arm arm took $(( $(date +%s) - T0 ))s"
done

SUMMARY=$DEST/stream-${IN}-${OUTLEN}-summary.md
{
  for arm in channels per-chunk; do
    [ -f "$DIR/bare/results.json" ] && [ -f "$DIR/$arm/results.json" ] && \
      $PY bench/compare_arms.py "$DIR/bare/results.json" "$DIR/$arm/results.json" \
        --title "$MODEL, ${IN} in / ${OUTLEN} out: bare vLLM vs stack ($arm)"
  done
  for arm in bare channels per-chunk; do
    [ -f "$DIR/$arm/summary.md" ] && { echo "## $arm"; cat "$DIR/$arm/summary.md"; }
  done
  cat "$DIR"/*.profile.md 2>/dev/null
} > "$SUMMARY"
cat "$SUMMARY" | head -n 40
tar -C "$DEST" --exclude='*.yaml' -czf "$DEST/stream-${IN}-${OUTLEN}.tar.gz" \
  "stream-${IN}-${OUTLEN}"
