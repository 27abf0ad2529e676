#!/usr/bin/env bash
# Stream smoothness on one GPU, in one command: bare `vllm serve`, the stack with its output
# channels (the default), the stack with `router.output_channels: false` (one Serve message per
# token chunk: the path before the channels) and the stack with two router replicas
# (`routers2`), same engine arguments, same `serve-app bench` load, REPEAT times per arm (runs
# `ARM`, `ARM-r2`, ...: one run per arm is within the noise of a 2% gap). Each arm then runs
# PROFILE_C streams for PROFILE_S seconds while bench/proc_cpu.py records every process's and
# thread's CPU (cores busy: a thread at 1.00 is a saturated stage) and py-spy, where it can
# attach, profiles the API server / the LLMServer replica and the router. The arms work in
# WORK/stream-IN-OUT; $OUT gets the summary, a tarball of the logs and summaries and one of the
# per-request results (the device tool returns a limited number of files).
#
# usage: bench/gpu_stream.sh IN_LEN OUT_LEN NUM_REQUESTS [CONCURRENCY] [CONFIG] [EXTRA_BENCH_ARGS...]
#   env: ARMS="bare channels per-chunk", REPEAT=1, CACHED= (1: rerun run 1's prompts),
#        PROFILE_C=256, PROFILE_S=12 (0: no profile)
# On the lent GPU host run it as `../shared/gpu/host.sh bench/gpu_stream.sh ...` (frees the GPU
# and ports an earlier command left, sets the bundle's environment); on your own GPU machine,
# with the project installed, run it directly (`make bench-stream`).
set -uo pipefail
. "$(dirname "$0")/arm_lib.sh"
IN=$1; OUTLEN=$2; NUM=$3; CONC=${4:-1,64,256}; CONFIG=${5:-deployments/gpu-1.yaml}
shift $(( $# < 5 ? $# : 5 ))
EXTRA=("$@")
PY=${PYTHON:-python3}
# The device tool returns at most 8 files from $OUT, none deeper than two folders, 16 MiB each:
# the arms work in WORK, and $OUT gets the summary and two tarballs (logs and summaries; the
# per-request results.json files).
DEST=${OUT:-bench/out}
WORK=${WORK:-${TMPDIR:-/tmp}/gpu-stream}
DIR=$WORK/stream-${IN}-${OUTLEN}
rm -rf "$DIR"  # a finished run of an earlier command on this host is not this one's arm
mkdir -p "$DIR" "$DEST"
PROFILE_C=${PROFILE_C:-256}; PROFILE_S=${PROFILE_S:-12}; REPEAT=${REPEAT:-1}
STACK_ARMS="channels per-chunk routers2"
MODEL=$($PY -c "from serve_app.config import load_config as l; print(l('$CONFIG').models[0].name)")
ensure_model "$CONFIG"

# The stack configs: the deployment as it is, with the output channels off, with two routers.
for arm in $STACK_ARMS; do
  $PY - "$CONFIG" "$arm" > "$DIR/$arm.yaml" <<'PY'
import sys
from pathlib import Path

import yaml

from serve_app.config import load_config

path, arm = sys.argv[1:3]
cfg = yaml.safe_load(Path(path).read_text())
cfg["models"][0]["path"] = load_config(path).models[0].path
router = cfg.setdefault("router", {})
router["output_channels"] = arm != "per-chunk"
router["server_timing"] = True  # the bench records where each request's TTFT went
if arm == "routers2":
    router["num_replicas"] = 2
print(yaml.safe_dump(cfg, sort_keys=False))
PY
done

bench() {  # url arm: REPEAT runs, each with prompts of its own (run r: seed 1000*(r-1)); with
  # CACHED=1 then run 1's prompts once more (`ARM-cached`: the prefix cache holds them)
  local r name seed
  for r in $(seq "$REPEAT") ${CACHED:+cached}; do
    if [ "$r" = cached ]; then name=$2-cached; seed=0
    else name=$2; [ "$r" -gt 1 ] && name=$2-r$r; seed=$((1000 * (r - 1))); fi
    $PY -m serve_app.cli bench --base-url "$1" --model "$MODEL" --input-len "$IN" \
      --output-len "$OUTLEN" --num-requests "$NUM" --concurrency "$CONC" --seed "$seed" \
      --token-range "${TOKEN_RANGE:-1000-20000}" --quiet --label "$name ${IN}/${OUTLEN}" \
      --out "$DIR/$name" "${EXTRA[@]}" > "$DIR/$name.log" 2>&1
    grep -A6 "^## Runs" "$DIR/$name/summary.md" || tail -n 20 "$DIR/$name.log"
  done
}
profile() {  # url arm: PROFILE_C streams for a while; CPU of every process, py-spy where it can
  [ "$PROFILE_S" -gt 0 ] || return 0
  $PY -m serve_app.cli bench --base-url "$1" --model "$MODEL" --input-len "$IN" \
    --output-len "$OUTLEN" --num-requests $((PROFILE_C * 4)) --concurrency "$PROFILE_C" \
    --duration $((PROFILE_S + 8)) --warmup 0 --quiet --label "profile" --out "$DIR/$2-profile" \
    > "$DIR/$2-profile.log" 2>&1 &
  # Wait for these pids only: a bare `wait` also waits for the arm's server, which runs in the
  # background until stop(); it held every earlier profile phase until the command's time limit.
  local waits=($!) parts="LLMServer Router"
  [ "$2" = bare ] && parts=api-server
  sleep 6
  $PY bench/proc_cpu.py --out "$DIR/$2-cpu.md" --threads 4 \
    --title "$2 arm, ${PROFILE_C} streams ${IN}/${OUTLEN}: cores busy per process" \
    -- sleep "$PROFILE_S" > /dev/null 2>&1 &
  waits+=($!)
  pyspy_parts "$DIR" "$2" "$PROFILE_S" $parts
  waits+=("${PYSPY_PIDS[@]}")
  wait "${waits[@]}"
  cat "$DIR/$2-cpu.md"
  pyspy_summaries "$DIR" "$2" "$2 arm, ${PROFILE_C} streams ${IN}/${OUTLEN}" $parts
}

# The summary and the tarball, rewritten after every arm: a command cut off by its time limit
# still returns the arms it finished (only files at most two folders below $OUT come back).
finish() {
  local SUMMARY=$DEST/stream-${IN}-${OUTLEN}-summary.md arm r sfx
  {
    for arm in $STACK_ARMS; do
      for r in $(seq "$REPEAT") ${CACHED:+cached}; do
        sfx=""; [ "$r" = cached ] && sfx=-cached; [ "$r" != cached ] && [ "$r" -gt 1 ] && sfx=-r$r
        [ -f "$DIR/bare$sfx/results.json" ] && [ -f "$DIR/$arm$sfx/results.json" ] && \
          $PY bench/compare_arms.py "$DIR/bare$sfx/results.json" "$DIR/$arm$sfx/results.json" \
            --title "$MODEL, ${IN} in / ${OUTLEN} out: bare vLLM vs stack ($arm), run $r"
      done
    done
    cat "$DIR"/*-cpu.md "$DIR"/*.profile.md 2>/dev/null
    for arm in bare $STACK_ARMS; do
      [ -f "$DIR/$arm/summary.md" ] && { echo "## $arm"; cat "$DIR/$arm/summary.md"; }
    done
  } > "$SUMMARY"
  tar -C "$WORK" --exclude='*.yaml' --exclude=results.json --exclude='*.png' \
    --exclude='*.pyspy.txt' -czf "$DEST/stream-${IN}-${OUTLEN}-logs.tgz" "stream-${IN}-${OUTLEN}"
  (cd "$WORK" && find "stream-${IN}-${OUTLEN}" -name results.json -print0 | \
    tar --null -T - -czf "$DEST/stream-${IN}-${OUTLEN}-results.tgz")
}

for arm in ${ARMS:-bare channels per-chunk}; do
  T0=$(date +%s)
  if [ "$arm" = bare ]; then
    BARE_CMD=$($PY -m serve_bench.arms "$CONFIG")
    echo "== bare vLLM: $BARE_CMD --port 8100"
    require_free_port 8100 || exit 1
    setsid bash -c "exec $BARE_CMD --port 8100" > "$DIR/bare-server.log" 2>&1 &
    PID=$!
    wait_ready http://127.0.0.1:8100 $PID 420 && bench http://127.0.0.1:8100 bare && \
      profile http://127.0.0.1:8100 bare
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
  finish
done
grep -B2 -A6 "^| conc" "$DEST/stream-${IN}-${OUTLEN}-summary.md"

