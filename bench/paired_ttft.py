"""Time to first token of two servers measured in pairs: the same prompt to A and to B, back to
back, one request in flight at a time, the order alternating from pair to pair.

Two servers compared in separate runs carry the machine's drift into the comparison: bare vLLM's
own TTFT p50 at c=1 moved from 32.4 to 39.3 ms between two H200 runs of the same prompts, where
the gap to measure is ~2 ms. Here both servers run at once on the same GPU (each with part of its
memory) and every pair sees the same moment, so the median of the per-pair differences measures
the stack's added latency. At c=1 only one request is on the GPU at a time.

usage: python bench/paired_ttft.py --a URL --b URL --model NAME --input-len 1024 \
           --output-len 128 --num 64 [--warmup 4] [--max-seconds S] [--out results.json]
Prints a markdown table (ms); ``--out`` gets every request's record and the summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp

from serve_app.bench.client import Target, send_one
from serve_app.bench.stats import RequestRecord, paired_difference, percentile
from serve_app.bench.workload import Tenant, iter_plan

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
        t0 = time.monotonic()
        for i, req in enumerate(plan):
            if args.max_seconds and time.monotonic() - t0 > args.max_seconds:
                break  # the pairs so far stand on their own; the table says how many
            for side in ("ab" if i % 2 == 0 else "ba"):
                records[side].append(await send_one(session, targets[side], req))
    pairs = [(x, y) for x, y in zip(records["a"], records["b"])
             if x.ok and y.ok and x.ttft is not None and y.ttft is not None]
    ttft = paired_difference([x.ttft * 1000 for x, _ in pairs],
                             [y.ttft * 1000 for _, y in pairs])
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
            "b_server_timing_p50_ms": timing,
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
    if result["b_server_timing_p50_ms"]:
        lines += ["", f"{label_b}'s Server-Timing p50 (ms): " + ", ".join(
            f"{k} {v:.2f}" for k, v in result["b_server_timing_p50_ms"].items())]
    return "\n".join(lines)


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
    ap.add_argument("--max-seconds", type=float, default=0,
                    help="start no new pair after this long (0: no limit)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--token-range", default="1000-20000")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    result = asyncio.run(run(args))
    if args.out:
        args.out.write_text(json.dumps(result))
    print(table(result, args.label_a, args.label_b))
    return 0 if not any(result["failed"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
