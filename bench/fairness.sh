#!/usr/bin/env bash
# The router's fair queue against FIFO on the embedded default: one tenant floods, one sends a
# little; the engine is capped at CAP requests in flight so a backlog forms in the router. The same
# load runs against a stack with `router.queue_policy: fifo` and one with `fair`.
# usage: bench/fairness.sh        (env: CAP, CONC, NUM, IN_LEN, OUT_LEN, PYTHON, OUT_DIR)
set -euo pipefail
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT_DIR:-bench/out/fairness}
CAP=${CAP:-4}; CONC=${CONC:-18}; N=${NUM:-180}; IN=${IN_LEN:-128}; OUTLEN=${OUT_LEN:-128}
mkdir -p "$OUT"
# Throwaway keys for this run only; results files record them redacted.
HEAVY=$("$PY" -c "from serve_app.governance.keys import new_key; print(new_key())")
LIGHT=$("$PY" -c "from serve_app.governance.keys import new_key; print(new_key())")
for policy in fifo fair; do
  "$PY" - "$policy" "$HEAVY" "$LIGHT" "$CAP" > "$OUT/config-$policy.yaml" <<'PY'
import sys
from pathlib import Path

import yaml

from serve_app.governance.keys import key_digest

policy, heavy, light, cap = sys.argv[1:5]
cfg = yaml.safe_load(Path("deployments/local-cpu.yaml").read_text())
cfg["models"][0]["path"] = str(Path("models/tiny-llama").resolve())
cfg.setdefault("router", {}).update(queue_policy=policy, max_in_flight_per_model=int(cap))
cfg["tenants"] = [{"name": "heavy", "api_key_sha256": [key_digest(heavy)]},
                  {"name": "light", "api_key_sha256": [key_digest(light)]}]
print(yaml.safe_dump(cfg, sort_keys=False))
PY
  CONFIG="$OUT/config-$policy.yaml" STACK_LOG="$OUT/stack-$policy.log" PYTHON="$PY" \
    bash bench/with_local_stack.sh "$PY" -m serve_app.cli bench --base-url http://127.0.0.1:8000 \
    --model tiny-llama --input-len "$IN" --output-len "$OUTLEN" --concurrency "$CONC" \
    --num-requests "$N" --warmup "$CONC" --tenant "heavy:$HEAVY:8" --tenant "light:$LIGHT:1" \
    --quiet --label "router queue: $policy (cap $CAP)" --out "$OUT/$policy" > "$OUT/$policy.log"
done
"$PY" - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
print("| queue | tenant | requests | output tok/s | TTFT p50 ms | TTFT p90 ms | E2EL p50 ms |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for policy in ("fifo", "fair"):
    run = json.load(open(f"{out}/{policy}/results.json"))["runs"][0]
    rows = [("all", run["summary"])] + sorted(run["tenants"].items())
    for name, s in rows:
        print(f"| {policy} | {name} | {s['completed']} | {s['output_throughput']:.0f} | "
              f"{s['ttft_ms']['median']:.0f} | {s['ttft_ms']['p90']:.0f} | "
              f"{s['e2el_ms']['median']:.0f} |")
PY
