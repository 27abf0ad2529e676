"""Time to first token of two servers measured in pairs: the same prompt to A and to B, back to
back, one request in flight at a time, the order alternating from pair to pair.

Two servers compared in separate runs carry the machine's drift into the comparison: bare vLLM's
own TTFT p50 at c=1 moved from 32.4 to 39.3 ms between two H200 runs of the same prompts, where
the gap to measure is ~2 ms. Here both servers run at once on the same GPU (each with part of its
memory) and every pair sees the same moment, so the median of the per-pair differences measures
the stack's added latency. At c=1 only one request is on the GPU at a time.

Each request starts after ``--gap-ms`` of quiet: the request before it, on the other server,
leaves work behind it (its engine's last steps, metric exports): on the H200, 128 in / 1024
out, the stack's TTFT was 2.8 ms longer when it went right after bare vLLM's 5 s stream than
when it went first (bench/RESULTS-archive.md 12d). The table shows each order's median as well.

With ``--a-metrics`` (server A's Prometheus endpoint, bare vLLM's ``/metrics``) the table also
has A's engine-side means over the measured requests, vLLM's own histograms: its TTFT from the
engine's intake (after tokenizing), the prefill and the engine queue, beside B's Server-Timing
means of the same phases. Two servers that differ only outside the engine show the same
figures there; where they differ, the time went inside the engine's front end or the GPU.

usage: python bench/paired_ttft.py --a URL --b URL --model NAME --input-len 1024 \
           --output-len 128 --num 64 [--warmup 4] [--gap-ms 50] [--a-metrics URL]
           [--max-seconds S] [--out results.json] [--pairs-csv pairs.csv]
Prints a markdown table (ms); ``--out`` gets every request's record and the summary,
``--pairs-csv`` one row per measured pair (both TTFTs, which went first, B's Server-Timing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp

from serve_bench.client import Target, send_one
from serve_bench.stats import RequestRecord, paired_difference, percentile
from serve_bench.workload import Tenant, iter_plan
from serve_app.observability.metrics import metric, vllm_native_name

# vLLM's request histograms (seconds) read from server A's /metrics, and the Server-Timing
# phases of server B that measure the same span ("replica - tokenize": handed to the engine ->
# the first output back in the caller's loop).
ENGINE_HISTOGRAMS = {
    "engine TTFT": vllm_native_name(metric("ray_vllm_time_to_first_token_seconds")),
    "engine queue": vllm_native_name(metric("ray_vllm_request_queue_time_seconds")),
    "prefill": vllm_native_name(metric("ray_vllm_request_prefill_time_seconds")),
}


async def histogram_totals(session: aiohttp.ClientSession, url: str) -> dict[str, tuple[float, float]]:
    """``(sum, count)`` of each :data:`ENGINE_HISTOGRAMS` series at ``url`` (all labels added)."""
    async with session.get(url) as resp:
        return totals_from_text(await resp.text())


def totals_from_text(text: str) -> dict[str, tuple[float, float]]:
    """``(sum, count)`` of each :data:`ENGINE_HISTOGRAMS` series in a Prometheus exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {name: label for label, name in ENGINE_HISTOGRAMS.items()}
    totals = {label: [0.0, 0.0] for label in ENGINE_HISTOGRAMS}
    for family in text_string_to_metric_families(text):
        label = wanted.get(family.name)
        if label is None:
            continue
        for sample in family.samples:
            if sample.name.endswith("_sum"):
                totals[label][0] += sample.value
            elif sample.name.endswith("_count"):
                totals[label][1] += sample.value
    return {label: (s, c) for label, (s, c) in totals.items()}


def engine_means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
                 ) -> dict[str, float]:
    """Mean of each histogram over the requests between two scrapes, in ms."""
    means = {}
    for label, (s1, c1) in after.items():
        s0, c0 = before.get(label, (0.0, 0.0))
        if c1 > c0:
            means[label] = (s1 - s0) / (c1 - c0) * 1000
    return means


def timing_means(records: list[RequestRecord]) -> dict[str, float]:
    """B's Server-Timing means (ms) of the spans :data:`ENGINE_HISTOGRAMS` name."""
    spans = {"engine TTFT": lambda t: t["replica"] - t.get("tokenize", 0.0),
             "engine queue": lambda t: t["engine_queue"], "prefill": lambda t: t["prefill"]}
    means = {}
    for label, span in spans.items():
        values = []
        for r in records:
            try:
                values.append(span(r.server_timing))
            except KeyError:
                continue
        if values:
            means[label] = sum(values) / len(values)
    return means


async def run(args: argparse.Namespace) -> dict:
    targets = {"a": Target(args.a, args.model), "b": Target(args.b, args.model)}
    tenant = Tenant("default", args.api_key, 1.0)
    lo, _, hi = args.token_range.partition("-")
    vocab = (int(lo), int(hi) + 1)
    records: dict[str, list[RequestRecord]] = {"a": [], "b": []}
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        warm_out = (min(args.output_len, 16),) * 2
        warm = iter_plan(args.warmup, (args.input_len,) * 2, warm_out, [tenant], vocab,
                         seed=args.seed + 1)
        for req in warm:  # compile paths and connections on both sides; short, not recorded
            for side in "ab":
                await send_one(session, targets[side], req)
        plan = iter_plan(args.num, (args.input_len,) * 2, (args.output_len,) * 2, [tenant],
                         vocab, seed=args.seed)
        before = await histogram_totals(session, args.a_metrics) if args.a_metrics else {}
        t0 = time.monotonic()
        b_second: list[bool] = []
        for i, req in enumerate(plan):
            if args.max_seconds and time.monotonic() - t0 > args.max_seconds:
                break  # the pairs so far stand on their own; the table says how many
            order = "ab" if i % 2 == 0 else "ba"
            b_second.append(order == "ab")
            for side in order:
                await asyncio.sleep(args.gap_ms / 1000)
                records[side].append(await send_one(session, targets[side], req))
        a_engine = (engine_means(before, await histogram_totals(session, args.a_metrics))
                    if args.a_metrics else {})
    measured = [(x, y, second) for x, y, second in zip(records["a"], records["b"], b_second)
                if x.ok and y.ok and x.ttft is not None and y.ttft is not None]
    pairs = [(x, y) for x, y, _ in measured]
    ttft = paired_difference([x.ttft * 1000 for x, _ in pairs],
                             [y.ttft * 1000 for _, y in pairs])
    by_order = {}
    for name, second in (("b_second", True), ("b_first", False)):
        diffs = [(y.ttft - x.ttft) * 1000 for x, y, s in measured if s == second]
        if diffs:
            by_order[name] = percentile(diffs, 50)
    tpot_pairs = [(x.tpot, y.tpot) for x, y in pairs if x.tpot and y.tpot]
    tpot = paired_difference([x * 1000 for x, _ in tpot_pairs], [y * 1000 for _, y in tpot_pairs])
    failed = {side: sum(not r.ok for r in recs) for side, recs in records.items()}
    timing = {}
    phases = sorted({k for r in records["b"] for k in r.server_timing})
    for name in phases:
        timing[name] = percentile([r.server_timing[name] for r in records["b"]
                                   if name in r.server_timing], 50)
    return {"a": args.a, "b": args.b, "model": args.model, "input_len": args.input_len,
            "output_len": args.output_len, "failed": failed, "ttft_ms": ttft, "tpot_ms": tpot,
            "ttft_diff_p50_by_order_ms": by_order, "gap_ms": args.gap_ms,
            "b_server_timing_p50_ms": timing, "a_engine_mean_ms": a_engine,
            "b_engine_mean_ms": timing_means([y for _, y in pairs]) if a_engine else {},
            "records": {side: [r.to_dict() for r in recs] for side, recs in records.items()}}


def table(result: dict, label_a: str, label_b: str) -> str:
    t, p = result["ttft_ms"], result["tpot_ms"]
    lines = [
        f"{result['input_len']} in / {result['output_len']} out, {t.get('pairs', 0)} pairs "
        f"(failed: {label_a} {result['failed']['a']}, {label_b} {result['failed']['b']})",
        "",
        f"| metric (ms) | {label_a} p50 | {label_b} p50 | {label_b} - {label_a}, median of pairs "
        "| 95% interval | mean | pairs where B is slower |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, s in (("TTFT", t), ("TPOT", p)):
        if s.get("pairs"):
            lines.append(f"| {name} | {s['a_p50']:.2f} | {s['b_p50']:.2f} | "
                         f"**{s['diff_p50']:+.2f}** | {s['diff_p50_ci_low']:+.2f} .. "
                         f"{s['diff_p50_ci_high']:+.2f} | {s['diff_mean']:+.2f} | "
                         f"{s['b_slower_share']:.0%} |")
    order = result.get("ttft_diff_p50_by_order_ms") or {}
    if order:
        lines += ["", f"TTFT {label_b} - {label_a} by order, median: {label_b} second "
                  f"{order.get('b_second', float('nan')):+.2f}, {label_b} first "
                  f"{order.get('b_first', float('nan')):+.2f} (gap before each request "
                  f"{result.get('gap_ms', 0):g} ms)"]
    a_engine, b_engine = result.get("a_engine_mean_ms") or {}, result.get("b_engine_mean_ms") or {}
    if a_engine:
        lines += ["", f"| engine side, mean (ms) | {label_a} (vLLM's histograms) | {label_b} "
                  "(Server-Timing) |", "| --- | --- | --- |"]
        for name in ENGINE_HISTOGRAMS:
            a_v, b_v = a_engine.get(name), b_engine.get(name)
            lines.append(f"| {name} | {'-' if a_v is None else f'{a_v:.2f}'} | "
                         f"{'-' if b_v is None else f'{b_v:.2f}'} |")
    if result["b_server_timing_p50_ms"]:
        lines += ["", f"{label_b}'s Server-Timing p50 (ms): " + ", ".join(
            f"{k} {v:.2f}" for k, v in result["b_server_timing_p50_ms"].items())]
    return "\n".join(lines)


def pairs_csv(result: dict, label_a: str, label_b: str) -> str:
    """One CSV row per pair that both servers answered: TTFTs (ms), which went first, and B's
    Server-Timing phases (the stack's account of where its time went), in the order it sent them."""
    rows = []
    phases: list[str] = []
    a_recs, b_recs = result["records"]["a"], result["records"]["b"]
    for i, (x, y) in enumerate(zip(a_recs, b_recs)):
        for name in y.get("server_timing") or {}:
            if name not in phases:
                phases.append(name)
        if x["ttft"] is None or y["ttft"] is None or x["status"] != 200 or y["status"] != 200:
            continue
        rows.append((i, x, y))
    out = [",".join(["pair", "first", f"{label_a}_ttft_ms", f"{label_b}_ttft_ms",
                     f"{label_b}_minus_{label_a}_ms", *phases])]
    for i, x, y in rows:
        first = label_a if i % 2 == 0 else label_b  # run() alternates, A first on even pairs
        timing = y.get("server_timing") or {}
        out.append(",".join([str(i), first, f"{x['ttft'] * 1000:.2f}", f"{y['ttft'] * 1000:.2f}",
                             f"{(y['ttft'] - x['ttft']) * 1000:.2f}",
                             *(f"{timing[k]:g}" if k in timing else "" for k in phases)]))
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, help="base URL of server A (before /v1)")
    ap.add_argument("--b", required=True, help="base URL of server B")
    ap.add_argument("--label-a", default="bare")
    ap.add_argument("--label-b", default="stack")
    ap.add_argument("--model", required=True)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num", type=int, default=64, help="pairs")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--gap-ms", type=float, default=50,
                    help="quiet time before each request (the other server's tail settles)")
    ap.add_argument("--a-metrics", default=None,
                    help="server A's Prometheus endpoint (bare vLLM: URL/metrics)")
    ap.add_argument("--max-seconds", type=float, default=0,
                    help="start no new pair after this long (0: no limit)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--token-range", default="1000-20000")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--pairs-csv", type=Path, help="one row per pair (small enough to keep)")
    args = ap.parse_args(argv)
    result = asyncio.run(run(args))
    if args.out:
        args.out.write_text(json.dumps(result))
    if args.pairs_csv:
        args.pairs_csv.write_text(pairs_csv(result, args.label_a, args.label_b))
    print(table(result, args.label_a, args.label_b))
    return 0 if not any(result["failed"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
