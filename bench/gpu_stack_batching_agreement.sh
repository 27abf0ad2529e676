#!/usr/bin/env bash
# On the GPU host, against the stack (one start): static vs continuous batching, then the agreement
# of `serve-app bench` with `vllm bench serve` on the same endpoint. Results land in $OUT
# (or bench/out/gpu-stack).
# usage: bench/gpu_stack_batching_agreement.sh [CONFIG] [BATCH] [NUM_REQUESTS]
#   env: BATCH_OUTPUT_LEN (16-512), BATCH_INPUT_LEN (512), AGREE_IN/AGREE_OUT/AGREE_NUM/AGREE_CONC,
#        ROUNDS (agreement rounds), SKIP_BATCHING=1 (agreement only)
set -uo pipefail
. "$(dirname "$0")/arm_lib.sh"
CONFIG=${1:-deployments/gpu-1.yaml}; B=${2:-64}; N=${3:-512}
export PYTHON=${PYTHON:-python3}
PY=$PYTHON
DEST=${OUT:-bench/out/gpu-stack}
mkdir -p "$DEST"
MODEL=$($PYTHON -c "from serve_app.config import load_config as l; print(l('$CONFIG').models[0].name)")
MPATH=$($PYTHON -c "from serve_app.config import load_config as l; print(l('$CONFIG').models[0].path)")
ensure_model "$CONFIG"
export CONFIG STACK_LOG=$DEST/stack-server.log READY_TIMEOUT_S=${READY_TIMEOUT_S:-420}
BATCH_CMD="$PYTHON -m serve_app.cli bench --base-url http://127.0.0.1:8000 --model $MODEL \
  --input-len ${BATCH_INPUT_LEN:-512} --output-len 128 --concurrency $B --num-requests $N \
  --warmup $B --static-vs-continuous $B --batching-output-len ${BATCH_OUTPUT_LEN:-16-512} --quiet \
  --label 'stack, static vs continuous, batch $B' --out $DEST/batching"
AGREE_CMD="OUT_DIR=$DEST/agreement IN_LEN=${AGREE_IN:-1024} OUT_LEN=${AGREE_OUT:-128} \
  NUM=${AGREE_NUM:-256} CONC=${AGREE_CONC:-64} bash bench/agreement.sh http://127.0.0.1:8000 \
  $MODEL $MPATH"
if [ "${SKIP_BATCHING:-0}" = 1 ]; then BATCH_CMD=true; fi
bash bench/with_local_stack.sh bash -c "$BATCH_CMD > $DEST/batching.log 2>&1; \
  grep -A8 'Static vs continuous' $DEST/batching/summary.md || tail -n 20 $DEST/batching.log; \
  $AGREE_CMD"
