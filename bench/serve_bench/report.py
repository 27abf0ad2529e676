"""Benchmark results as files: one JSON, a Markdown summary and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROW_METRICS = [
    ("output tok/s", lambda s: f"{s['output_throughput']:.1f}"),
    ("req/s", lambda s: f"{s['request_throughput']:.2f}"),
    ("TTFT p50 ms", lambda s: f"{s['ttft_ms']['median']:.1f}"),
    ("TTFT p99 ms", lambda s: f"{s['ttft_ms']['p99']:.1f}"),
    ("TPOT p50 ms", lambda s: f"{s['tpot_ms']['median']:.2f}"),
    ("ITL p50 ms", lambda s: f"{s['itl_ms']['median']:.2f}"),
    ("E2EL p90 ms", lambda s: f"{s['e2el_ms']['p90']:.1f}"),
    ("failed", lambda s: str(s["failed"])),
]


def _table(rows: list[tuple[str, dict[str, Any]]]) -> list[str]:
    head = "| run | " + " | ".join(name for name, _ in ROW_METRICS) + " |"
    sep = "|" + " --- |" * (len(ROW_METRICS) + 1)
    lines = [head, sep]
    for label, s in rows:
        lines.append(f"| {label} | " + " | ".join(f(s) for _, f in ROW_METRICS) + " |")
    return lines


def markdown(result: dict[str, Any]) -> str:
    """A human summary of ``result`` (the structure :func:`write` saves as JSON)."""
    lines = [f"# Benchmark: {result['label']}", "", f"- command: `{result['command']}`",
             f"- target: {result['target']}", f"- date: {result['date']}",
             f"- workload: {result['workload']}", ""]
    runs = result.get("runs", [])
    if runs:
        lines += ["## Runs", ""]
        lines += _table([(r["name"], r["summary"]) for r in runs])
        lines.append("")
        for r in runs:
            if len(r.get("tenants", {})) > 1:
                lines += [f"### Per tenant: {r['name']}", ""]
                lines += _table(list(r["tenants"].items()))
                lines.append("")
    cmp = result.get("static_vs_continuous")
    if cmp:
        lines += ["## Static vs continuous batching", "",
                  f"Batch size {cmp['batch']}; output lengths {cmp['output_len']} (mixed).", ""]
        lines += _table([("static", cmp["static"]), ("continuous", cmp["continuous"])])
        lines += ["", f"**Continuous / static output throughput: {cmp['ratio']:.2f}x**", ""]
    return "\n".join(lines) + "\n"


def _plots(result: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: list[Path] = []
    sweep = [r for r in result.get("runs", []) if r.get("concurrency")]
    if sweep:
        xs = [r["concurrency"] for r in sweep]
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        a.plot(xs, [r["summary"]["output_throughput"] for r in sweep], "o-")
        a.set(xlabel="concurrency", ylabel="output tokens/s", title="Throughput", xscale="log")
        for key, style in (("ttft_ms", "o-"), ("tpot_ms", "s--"), ("e2el_ms", "^:")):
            b.plot(xs, [r["summary"][key]["median"] for r in sweep], style,
                   label=key.split("_")[0].upper() + " p50")
            b.plot(xs, [r["summary"][key]["p99"] for r in sweep], style, alpha=0.4,
                   label=key.split("_")[0].upper() + " p99")
        b.set(xlabel="concurrency", ylabel="ms", title="Latency", xscale="log", yscale="log")
        b.legend(fontsize=7)
        fig.suptitle(result["label"])
        fig.tight_layout()
        paths.append(out / "throughput_latency.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    service = result.get("service_over_time")
    if service and service.get("series"):
        fig, ax = plt.subplots(figsize=(8, 4))
        for tenant, row in sorted(service["series"].items()):
            ax.plot([i * service["bin_s"] for i in range(len(row))], row, label=tenant)
        ax.set(xlabel="seconds", ylabel="output tokens/s", title="Service per tenant over time")
        ax.legend()
        fig.tight_layout()
        paths.append(out / "tenant_service.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    cmp = result.get("static_vs_continuous")
    if cmp:
        fig, ax = plt.subplots(figsize=(5, 4))
        vals = [cmp["static"]["output_throughput"], cmp["continuous"]["output_throughput"]]
        ax.bar(["static", "continuous"], vals, color=["#999", "#2a7"])
        ax.set(ylabel="output tokens/s", title=f"Batch {cmp['batch']}: {cmp['ratio']:.2f}x")
        fig.tight_layout()
        paths.append(out / "static_vs_continuous.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def write(result: dict[str, Any], out: Path) -> list[Path]:
    """Write results.json, summary.md and the plots into ``out``; return the paths."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2))
    (out / "summary.md").write_text(markdown(result))
    return [out / "results.json", out / "summary.md", *_plots(result, out)]
