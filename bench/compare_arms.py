"""Print the stack-vs-bare ratios of two `serve-app bench` results (same workload, same GPU).

usage: python bench/compare_arms.py BARE/results.json STACK/results.json [--md OUT.md]
    [--names A,B]   (the arms' names in the table's header: "bare,stack" unless given, e.g.
    "off,on" for the traces A/B of bench/gpu_tracing.sh; the ratio is always second / first)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def compare(bare: dict, stack: dict) -> list[dict]:
    rows = []
    stack_runs = {r["concurrency"]: r["summary"] for r in stack["runs"]}
    for run in bare["runs"]:
        c, b = run["concurrency"], run["summary"]
        s = stack_runs.get(c)
        if s is None:
            continue
        rows.append({
            "concurrency": c,
            "bare_out_tok_s": b["output_throughput"], "stack_out_tok_s": s["output_throughput"],
            "throughput_ratio": s["output_throughput"] / max(b["output_throughput"], 1e-9),
            "bare_ttft_p50": b["ttft_ms"]["median"], "stack_ttft_p50": s["ttft_ms"]["median"],
            "ttft_p50_delta_ms": s["ttft_ms"]["median"] - b["ttft_ms"]["median"],
            "bare_ttft_p99": b["ttft_ms"]["p99"], "stack_ttft_p99": s["ttft_ms"]["p99"],
            "bare_tpot_p50": b["tpot_ms"]["median"], "stack_tpot_p50": s["tpot_ms"]["median"],
            "tpot_p50_ratio": s["tpot_ms"]["median"] / max(b["tpot_ms"]["median"], 1e-9),
            "bare_itl_p50": b["itl_ms"]["median"], "stack_itl_p50": s["itl_ms"]["median"],
            "itl_p50_ratio": s["itl_ms"]["median"] / max(b["itl_ms"]["median"], 1e-9),
            "failed": b["failed"] + s["failed"],
        })
    return rows


def markdown(rows: list[dict], title: str, names: tuple[str, str] = ("bare", "stack")) -> str:
    a, b = names
    lines = [f"### {title}", "",
             f"| conc | {a} out tok/s | {b} out tok/s | ratio | TTFT p50 {a} / {b} (ms) "
             f"| TTFT p99 {a} / {b} (ms) | TPOT p50 {a} / {b} (ms) | TPOT ratio "
             f"| ITL p50 {a} / {b} (ms) | ITL ratio | failed |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(
            f"| {r['concurrency']} | {r['bare_out_tok_s']:.0f} | {r['stack_out_tok_s']:.0f} | "
            f"{r['throughput_ratio']:.3f} | {r['bare_ttft_p50']:.1f} / {r['stack_ttft_p50']:.1f} | "
            f"{r['bare_ttft_p99']:.1f} / {r['stack_ttft_p99']:.1f} | "
            f"{r['bare_tpot_p50']:.2f} / {r['stack_tpot_p50']:.2f} | {r['tpot_p50_ratio']:.3f} | "
            f"{r['bare_itl_p50']:.2f} / {r['stack_itl_p50']:.2f} | {r['itl_p50_ratio']:.2f} | "
            f"{r['failed']} |")
    return "\n".join(lines) + "\n"


def server_timing(stack: dict) -> str:
    """The stack's own account of its requests' TTFT (``Server-Timing``), p50 per phase."""
    from serve_bench.stats import percentile
    from serve_app.engine.timing import PHASES

    lines = []
    for run in stack["runs"]:
        seen = [r["server_timing"] for r in run["records"] if r.get("server_timing")]
        if not seen:
            continue
        if not lines:
            lines = ["", "Server-Timing p50 (ms) of the stack's requests:", "",
                     "| conc | requests | " + " | ".join(PHASES) + " |",
                     "| --- | --- | " + " | ".join("---" for _ in PHASES) + " |"]
        values = [[t[p] for t in seen if p in t] for p in PHASES]
        cells = [f"{percentile(v, 50):.2f}" if v else "-" for v in values]
        lines.append(f"| {run['concurrency']} | {len(seen)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + ("\n" if lines else "")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("bare")
    p.add_argument("stack")
    p.add_argument("--md", default=None)
    p.add_argument("--title", default="stack vs bare vLLM")
    p.add_argument("--names", default="bare,stack")
    a = p.parse_args()
    bare, stack = (json.loads(Path(x).read_text()) for x in (a.bare, a.stack))
    rows = compare(bare, stack)
    first, second = a.names.split(",")
    text = markdown(rows, a.title, (first, second)) + server_timing(stack)
    print(text)
    if a.md:
        Path(a.md).write_text(text)


if __name__ == "__main__":
    main()
