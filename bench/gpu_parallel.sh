#!/usr/bin/env bash
# The parallelism runs on a host with two GPUs (the `nvidia-h200-x2` kind), one run per command
# (each fits one 10-minute call on a warm host):
#
#   tp2         deployments/gpu-tp2.yaml (one replica, TP=2 over both GPUs): the GPU tests on it
#               (placement.json), then c=1 TPOT of that replica and of one on one GPU
#               (deployments/gpu-1.yaml), each alone on the host, `serve-app bench` both
#   pp2-2nodes  two Ray nodes of one GPU each (tests/integration/local_cluster.py with
#               CLUSTER_GPUS=0,1); the GPU tests with deployments/gpu-pp2-2nodes.yaml on that
#               cluster, which also check that the replica's two stages lie on the two nodes
#   2replicas   deployments/gpu-2replicas.yaml: two TP=1 replicas at c=512, then the same app
#               with one replica (`serve-app deploy`, applied in place) at c=256, one stack start;
#               `serve-app status` after each gives the requests each engine replica took
#   pp2-node-loss four Ray nodes, two on each GPU, and two PP=2 replicas (a stage per node):
#               the node of one replica's second stage killed under load, then returned
#               (tests/gpu/test_node_loss.py; the times into node-loss.json). Three engine
#               starts of PP=2 in one call: run it after pp2-2nodes on the same host, whose
#               start leaves vLLM's compile cache warm for this shape
#
# usage: bench/gpu_parallel.sh RUN        env: IN=1024 OUT_LEN=128 (the c=512 / c=256 shape);
#   CONFIG (2replicas: another two-replica config, e.g. a CPU one for a dry run of the script),
#   NUMS="1024 512" (requests at c=512 and c=256), CONCS="512 256"
# $OUT gets parallel-RUN.md (the figures) and the logs. Not yet run on a two-GPU host: the kind
# was not lent when this was written (the scripts it reuses ran on one H200).
# On the lent GPU host run it as `../shared/gpu/host.sh bench/gpu_parallel.sh ...` (frees the GPU
# and ports an earlier command left, sets the bundle's environment); on your own GPU machine,
# with the project installed, run it directly (`make bench-parallel RUN=...`).
set -uo pipefail
. "$(dirname "$0")/arm_lib.sh"
RUN=${1:?usage: bench/gpu_parallel.sh tp2|pp2-2nodes|2replicas|pp2-node-loss}
PY=${PYTHON:-python3}
DEST=${OUT:-bench/out}
DIR=${WORK:-${TMPDIR:-/tmp}/gpu-parallel}/$RUN
rm -rf "$DIR"; mkdir -p "$DIR" "$DEST"
REPORT=$DEST/parallel-$RUN.md
T0=$(date +%s)
MODEL=$($PY -c "from serve_app.config import load_config as l; print(l('deployments/gpu-1.yaml').models[0].name)")

bench() {  # url label conc num in out: one `serve-app bench` level into $DIR/label
  $PY -m serve_app.cli bench --base-url "$1" --model "$MODEL" --concurrency "$3" \
    --num-requests "$4" --input-len "$5" --output-len "$6" --warmup 2 --seed 100 --quiet \
    --token-range "${TOKEN_RANGE:-1000-20000}" \
    --label "$2" --out "$DIR/$2" > "$DIR/$2.log" 2>&1
  $PY - "$DIR/$2/results.json" "$2" <<'PY' | tee -a "$REPORT"
import json, sys
for run in json.load(open(sys.argv[1]))["runs"]:
    s = run["summary"]
    print(f"| {sys.argv[2]} | {run['concurrency']} | {s['output_throughput']:.0f} | "
          f"{s['tpot_ms']['median']:.2f} | {s['itl_ms']['median']:.2f} | "
          f"{s['ttft_ms']['median']:.1f} | {s['failed']} |")
PY
}

serve_config() {  # config: `serve-app run` in the background; STACK gets its pid
  ensure_model "$1"
  require_free_port 8000 || exit 1
  setsid $PY -m serve_app.cli run --config "$1" --port 8000 > "$DIR/$(basename "$1").log" 2>&1 &
  STACK=$!
  wait_ready http://127.0.0.1:8000 "$STACK" 540 || { stop "$STACK"; exit 1; }
  wait_running
}

wait_running() {  # [N]: until every deployment has all its replicas RUNNING (and each
  # model's engines N of them): the app answers as soon as one engine replica does, and a
  # level measured then left the second replica out
  for _ in $(seq 240); do
    $PY -m serve_app.cli status 2>/dev/null | $PY -c "import json, sys; s = json.load(sys.stdin); n = sys.argv[1]; sys.exit(0 if s['status'] == 'RUNNING' and all(set(d) == {'RUNNING'} and (not n or not k.startswith('LLMServer') or d['RUNNING'] == int(n)) for k, d in s['deployments'].items()) else 1)" "${1:-}" && return 0
    sleep 2
  done
  echo "the app did not reach RUNNING"; return 1
}

gpu_tests() {  # config [env...]: the GPU tests on it, placement.json into $DIR
  local config=$1; shift
  env SERVE_APP_GPU_CONFIG="$config" OUT="$DIR" "$@" $PY -m pytest -v -s tests/gpu \
    > "$DIR/gpu-tests.log" 2>&1
  local rc=$?
  { echo; echo "GPU tests on $config: exit $rc"; tail -n 5 "$DIR/gpu-tests.log"; } >> "$REPORT"
}

TABLE="| arm | conc | out tok/s | TPOT p50 (ms) | ITL p50 (ms) | TTFT p50 (ms) | failed |
| --- | --- | --- | --- | --- | --- | --- |"
case $RUN in
  tp2)
    echo "### TP=2 on two GPUs against one GPU (c=1, 128 in / 512 out)" > "$REPORT"
    gpu_tests deployments/gpu-tp2.yaml
    echo "$TABLE" >> "$REPORT"
    for config in deployments/gpu-tp2.yaml deployments/gpu-1.yaml; do
      serve_config "$config"
      bench http://127.0.0.1:8000 "$(basename "$config" .yaml)" 1 16 128 512
      stop "$STACK"
    done
    ;;
  pp2-2nodes)
    echo "### PP=2 over two Ray nodes of one GPU each" > "$REPORT"
    start_cluster "$DIR" 0,1 8 || exit 1
    gpu_tests deployments/gpu-pp2-2nodes.yaml SERVE_APP_GPU_ADDRESS="$ADDRESS" \
      SERVE_APP_GPU_REPLICA_NODES=2
    $PY - "$DIR/placement.json" <<'PY' | tee -a "$REPORT"
import json, sys
p = json.load(open(sys.argv[1]))
for g in p["placement_groups"].values():
    print(f"\n{g['name']}: {g['strategy']} {g['state']}")
    for i, b in g["bundles"].items():
        print(f"- bundle {i} {b} on node {g['bundles_to_node_id'][i][:12]}")
PY
    stop_cluster
    ;;
  2replicas)
    IN=${IN:-1024}; OUT_LEN=${OUT_LEN:-128}
    echo "### Two TP=1 replicas against one ($IN in / $OUT_LEN out)" > "$REPORT"
    echo "$TABLE" >> "$REPORT"
    CONFIG=${CONFIG:-deployments/gpu-2replicas.yaml}
    MODEL=$($PY -c "from serve_app.config import load_config as l; print(l('$CONFIG').models[0].name)")
    read -r NUM2 NUM1 <<< "${NUMS:-1024 512}"; read -r C2 C1 <<< "${CONCS:-512 256}"
    serve_config "$CONFIG"
    bench http://127.0.0.1:8000 two-replicas "$C2" "$NUM2" "$IN" "$OUT_LEN"
    $PY -m serve_app.cli status > "$DIR/status-two.json"
    # The same app with one replica: replica counts apply in place, nothing else restarts.
    $PY - "$CONFIG" > "$DIR/one-replica.yaml" <<'PY'
import sys, yaml
from serve_app.config import load_config
cfg = yaml.safe_load(open(sys.argv[1]))
cfg["models"][0]["path"] = str(load_config(sys.argv[1]).models[0].path)  # as it was resolved
cfg["models"][0]["autoscaling"] = {"min_replicas": 1, "max_replicas": 1}
print(yaml.safe_dump(cfg, sort_keys=False))
PY
    $PY -m serve_app.cli deploy --config "$DIR/one-replica.yaml" --address auto \
      > "$DIR/deploy.log" 2>&1
    wait_running 1
    bench http://127.0.0.1:8000 one-replica "$C1" "$NUM1" "$IN" "$OUT_LEN"
    $PY -m serve_app.cli status > "$DIR/status-one.json"
    $PY - "$DIR" <<'PY' | tee -a "$REPORT"
import json, sys
d = sys.argv[1]
two = json.load(open(f"{d}/two-replicas/results.json"))
one = json.load(open(f"{d}/one-replica/results.json"))
def tput(r):
    return r["runs"][-1]["summary"]["output_throughput"]
print(f"\ntwo replicas / one: **{tput(two) / tput(one):.3f}x** output throughput")
for name in ("two", "one"):
    s = json.load(open(f"{d}/status-{name}.json"))
    for model, view in s["models"].items():
        counts = [(r["node"][:8], r["requests_total"]) for r in view["per_replica"]]
        print(f"- after the {name}-replica level, {model}: requests taken per engine replica {counts}")
PY
    stop "$STACK"
    ;;
  pp2-node-loss)
    echo "### Losing the node of one pipeline stage under load (two PP=2 replicas, four nodes)" \
      > "$REPORT"
    OUT="$DIR" $PY -m pytest -v -s tests/gpu/test_node_loss.py > "$DIR/node-loss-test.log" 2>&1
    { echo "test: exit $?"; tail -n 5 "$DIR/node-loss-test.log"; echo '```'
      cat "$DIR/node-loss.json" 2>/dev/null; echo '```'; } >> "$REPORT"
    ;;
  *) echo "unknown run $RUN"; exit 2 ;;
esac
cp "$DIR"/*.log "$DIR"/*.json "$DEST"/ 2>/dev/null
echo "took $(( $(date +%s) - T0 ))s"
cat "$REPORT"
