#!/usr/bin/env bash
# Does `serve-app bench` agree with `vllm bench serve` on the same endpoint and load?
# Run against a running endpoint (see bench/with_local_stack.sh); prints both tools' figures.
# usage: bench/agreement.sh [BASE_URL] [MODEL] [TOKENIZER]
set -euo pipefail
BASE=${1:-http://127.0.0.1:8000}; MODEL=${2:-tiny-llama}; TOK=${3:-models/tiny-llama}
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT_DIR:-bench/out/agreement}
IN=${IN_LEN:-128}; OUTLEN=${OUT_LEN:-64}; N=${NUM:-160}; C=${CONC:-16}
mkdir -p "$OUT"
ROUNDS=${ROUNDS:-2}
# Both tools warm up with C requests before measuring. vLLM's prefix cache would serve a repeated
# prompt from cache, so every run draws new random prompts (its own seed) and no run is faster
# than another for having followed it.
WARM=(--num-warmups "$C")
HELP=$("$PY" -m serve_app.cli vllm bench serve --help=all 2>/dev/null || true)
[[ $HELP == *--num-warmups* ]] || WARM=()
# The tools take turns (vllm, ours, vllm, ours, ...) so drift of the server shows in both.
for r in $(seq "$ROUNDS"); do
  "$PY" -m serve_app.cli vllm bench serve --backend openai --base-url "$BASE" --endpoint /v1/completions \
    --model "$MODEL" --tokenizer "$TOK" --dataset-name random --random-input-len "$IN" \
    --random-output-len "$OUTLEN" --num-prompts "$N" --max-concurrency "$C" --ignore-eos \
    --seed "$r" "${WARM[@]}" \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 \
    --save-result --result-dir "$OUT" --result-filename "vllm-$r.json" > "$OUT/vllm-$r.log" 2>&1
  "$PY" -m serve_app.cli bench --base-url "$BASE" --model "$MODEL" --input-len "$IN" \
    --output-len "$OUTLEN" --num-requests "$N" --concurrency "$C" --warmup "$C" --quiet \
    --seed $((100 * r)) \
    --out "$OUT/serve-app-$r" > "$OUT/serve-app-$r.log"
done
"$PY" - "$OUT" "$ROUNDS" <<'PY'
import json, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def mean(xs): return sum(xs) / len(xs)
ours_all = [json.load(open(f"{out}/serve-app-{r}/results.json"))["runs"][0]["summary"]
            for r in range(1, rounds + 1)]
theirs_all = [json.load(open(f"{out}/vllm-{r}.json")) for r in range(1, rounds + 1)]
ours = {"output_throughput": mean([o["output_throughput"] for o in ours_all]),
        "request_throughput": mean([o["request_throughput"] for o in ours_all]),
        "failed": sum(o["failed"] for o in ours_all)}
for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
    ours[key] = {"median": mean([o[key]["median"] for o in ours_all])}
theirs = {k: mean([t[k] for t in theirs_all]) for k in (
    "output_throughput", "request_throughput", "median_ttft_ms", "median_tpot_ms",
    "median_itl_ms", "median_e2el_ms")}
theirs["failed"] = sum(t.get("failed", 0) for t in theirs_all)
print(f"means over {rounds} alternating rounds; per round, serve-app / vllm output tok/s: "
      + ", ".join(f"{o['output_throughput']:.0f} / {t['output_throughput']:.0f}"
                  for o, t in zip(ours_all, theirs_all)))
rows = [("output tok/s", ours["output_throughput"], theirs["output_throughput"]),
        ("request/s", ours["request_throughput"], theirs["request_throughput"]),
        ("TTFT p50 ms", ours["ttft_ms"]["median"], theirs["median_ttft_ms"]),
        ("TPOT p50 ms", ours["tpot_ms"]["median"], theirs["median_tpot_ms"]),
        ("ITL p50 ms", ours["itl_ms"]["median"], theirs["median_itl_ms"]),
        ("E2EL p50 ms", ours["e2el_ms"]["median"], theirs["median_e2el_ms"])]
print("| metric | serve-app bench | vllm bench serve | difference |")
print("| --- | --- | --- | --- |")
for name, a, b in rows:
    print(f"| {name} | {a:.2f} | {b:.2f} | {100 * (a - b) / b:+.1f}% |")
print(f"\nfailed: serve-app {ours['failed']}, vllm {theirs.get('failed', 0)}")
PY
