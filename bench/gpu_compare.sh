#!/usr/bin/env bash
# Stack vs bare vLLM on one GPU, in one command: both arms get the engine arguments of one
# deployment config, are started one after the other on the same GPU, warmed up, and driven by
# the same `serve-app bench` load. Results land in $OUT (or bench/out).
#
# usage: bench/gpu_compare.sh IN_LEN OUT_LEN NUM_REQUESTS [CONCURRENCY] [CONFIG] [EXTRA_BENCH_ARGS...]
#   e.g. bench/gpu_compare.sh 1024 128 32,256,512 1,64,256
#   A config with tenants: pass their keys as bench arguments (`--tenant name:KEY:share`, one
#   or more); the stack's readiness is then waited for with the first of them, since
#   /v1/models answers 401 without a key (API_KEY=... overrides; bare vLLM ignores keys).
# On the lent GPU host run it as `../shared/gpu/host.sh bench/gpu_compare.sh ...` (frees the GPU
# and ports an earlier command left, sets the bundle's environment); on your own GPU machine,
# with the project installed, run it directly (`make bench-vs-bare`).
set -uo pipefail
. "$(dirname "$0")/arm_lib.sh"
IN=$1; OUTLEN=$2; NUM=$3; CONC=${4:-1,64,256}; CONFIG=${5:-deployments/gpu-1.yaml}
shift $(( $# < 5 ? $# : 5 ))
EXTRA=("$@")
PY=${PYTHON:-python3}
NAME=cmp-${IN}-${OUTLEN}
DEST=${OUT:-bench/out}
# Everything goes straight under $DEST, so what finished survives a command cut off by a time limit.
DIR=$DEST/$NAME
mkdir -p "$DIR"
MODEL=$($PY -c "from serve_app.config import load_config as l; print(l('$CONFIG').models[0].name)")
# The config's model folder; written as a config-only shape (SHAPE) when missing.
ensure_model "$CONFIG"
# The key readiness is asked with: API_KEY, else the first `--tenant name:KEY:share` argument.
READY_KEY=${API_KEY:-}
for ((i = 0; i < ${#EXTRA[@]}; i++)); do
  [ -n "$READY_KEY" ] && break
  spec=""
  case "${EXTRA[$i]}" in
    --tenant=*) spec=${EXTRA[$i]#--tenant=} ;;
    --tenant) spec=${EXTRA[$((i + 1))]:-} ;;
  esac
  [ -n "$spec" ] && { rest=${spec#*:}; READY_KEY=${rest%:*}; }
done

bench() {  # url arm
  $PY -m serve_app.cli bench --base-url "$1" --model "$MODEL" --input-len "$IN" \
    --output-len "$OUTLEN" --num-requests "$NUM" --concurrency "$CONC" --token-range "${TOKEN_RANGE:-1000-20000}" \
    --quiet --label "$2 ${IN}/${OUTLEN}" --out "$DIR/$2" "${EXTRA[@]}" > "$DIR/$2.log" 2>&1
  grep -A6 "^## Runs" "$DIR/$2/summary.md" || tail -n 20 "$DIR/$2.log"
}

BARE_CMD=$($PY -m serve_bench.arms "$CONFIG")
echo "== bare vLLM: $BARE_CMD --port 8100"
T0=$(date +%s)
require_free_port 8100 || exit 1
setsid bash -c "exec $BARE_CMD --port 8100" > "$DIR/bare-server.log" 2>&1 &
BARE=$!
wait_ready http://127.0.0.1:8100 $BARE 420 && bench http://127.0.0.1:8100 bare
stop $BARE
echo "bare arm took $(( $(date +%s) - T0 ))s"

echo "== stack: serve-app run --config $CONFIG"
T0=$(date +%s)
require_free_port 8000 || exit 1
setsid $PY -m serve_app.cli run --config "$CONFIG" --port 8000 > "$DIR/stack-server.log" 2>&1 &
STACK=$!
wait_ready http://127.0.0.1:8000 $STACK 420 "$READY_KEY" && bench http://127.0.0.1:8000 stack
stop $STACK
echo "stack arm took $(( $(date +%s) - T0 ))s"

$PY bench/compare_arms.py "$DIR/bare/results.json" "$DIR/stack/results.json" \
  --md "$DIR/compare.md" --title "$MODEL, ${IN} in / ${OUTLEN} out"
cat "$DIR/compare.md"
