"""Helpers of bench/gpu_lora.sh (issue 39): read the adapter swaps around a run and write the
two parts' tables.

    python bench/lora_report.py swaps OUT.json [--sd FILE]
        ray_serve_app_adapter_swaps_total per engine replica and event (load, evict), summed
        over the adapters and over every Ray metrics agent the service-discovery file names
    python bench/lora_report.py mix DIR
        part mix: the lora arm against the base arm per concurrency (bench/compare_arms.py's
        table: output tok/s and its ratio lora / base, TTFT p50/p99, TPOT p50), then each
        tenant's requests, output tok/s and TTFT p50 in both arms at the highest concurrency
    python bench/lora_report.py affinity DIR
        part affinity: one row per arm (DIR/N-POLICY/{results.json, before.json, after.json,
        swaps-before.json, swaps-after.json, status.json}): TTFT p50/p99, output tok/s, TPOT
        p50, adapter loads and evictions, and per replica its loads and evictions, requests
        finished and the adapters it held at the end; then each policy against power_of_two
        (means over repeats)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

SD_FILE = "/tmp/ray/session_latest/prom_metrics_service_discovery.json"
SWAPS = "ray_serve_app_adapter_swaps_total"
EVENTS = ("load", "evict")
_LINE = re.compile(r"^(\w+)\{([^}]*)\}\s+([0-9.eE+-]+|NaN)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def parse_swaps(text: str) -> dict[str, dict[str, float]]:
    """Replica -> {load, evict} from a Prometheus text page (summed over adapters and models).
    The replica is Serve's ``replica`` tag (``ReplicaId`` where an exporter names it so)."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if not m or m.group(1) != SWAPS:
            continue
        labels = dict(_LABEL.findall(m.group(2)))
        replica = labels.get("replica") or labels.get("ReplicaId") or ""
        per = out.setdefault(replica, dict.fromkeys(EVENTS, 0.0))
        event = labels.get("event", "")
        per[event] = per.get(event, 0.0) + float(m.group(3))
    return out


def read_swaps(sd_file: str) -> dict[str, dict[str, float]]:
    """:func:`parse_swaps` of every metrics agent, summed (one read)."""
    from prefix_affinity_report import read_agents

    return read_agents(sd_file, parse_swaps, EVENTS)


def swap_deltas(before: dict[str, Any], after: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per replica: loads and evictions during the run (after - before)."""
    out = {}
    for replica, a in after.items():
        b = before.get(replica, {})
        out[replica] = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in EVENTS}
    return out


def _short(replica: str) -> str:
    """A replica's id as the reports give it (Serve's random suffix), at most 8 characters."""
    return replica.rsplit("#", 1)[-1][-8:] if replica else "?"


def _run(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())["runs"][-1]


def mix_table(root: Path) -> str:
    from compare_arms import compare, markdown

    base, lora = root / "base" / "results.json", root / "lora" / "results.json"
    if not (base.exists() and lora.exists()):
        have = [p.name for p in sorted(root.iterdir()) if (p / "results.json").exists()]
        return f"(no comparison: arms with results: {have or 'none'})\n"
    b, lo = json.loads(base.read_text()), json.loads(lora.read_text())
    out = [markdown(compare(b, lo), "lora (8 adapters) against base (no LoRA)",
                    names=("base", "lora"))]
    rb, rl = b["runs"][-1], lo["runs"][-1]
    out += ["", f"Per tenant at c={rl['concurrency']} (requests, out tok/s, TTFT p50 ms), "
            "base | lora:", "",
            "| tenant | base: requests | out tok/s | TTFT p50 | lora: requests | out tok/s | "
            "TTFT p50 |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for t in sorted(set(rb["tenants"]) | set(rl["tenants"])):
        cells = []
        for run in (rb, rl):
            s = run["tenants"].get(t)
            cells += (["-"] * 3 if s is None else
                      [str(s["completed"]), f"{s['output_throughput']:.0f}",
                       f"{s['ttft_ms']['median']:.1f}"])
        out.append(f"| {t} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def affinity_table(root: Path) -> str:
    from prefix_affinity_report import hit_rates

    rows = ["| # | policy | TTFT p50 (ms) | TTFT p99 (ms) | out tok/s | TPOT p50 (ms) | "
            "adapter loads / evictions | per replica: loads / evictions, requests, adapters "
            "held at the end | failed |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    by_policy: dict[str, list[dict[str, float]]] = {}
    for arm in sorted(p for p in root.iterdir() if (p / "results.json").exists()):
        n, _, policy = arm.name.partition("-")
        s = _run(arm / "results.json")["summary"]
        swaps: dict[str, dict[str, float]] = {}
        if (arm / "swaps-before.json").exists() and (arm / "swaps-after.json").exists():
            swaps = swap_deltas(json.loads((arm / "swaps-before.json").read_text()),
                                json.loads((arm / "swaps-after.json").read_text()))
        finished: dict[str, float] = {}
        if (arm / "before.json").exists() and (arm / "after.json").exists():
            finished = {r: d["finished"] for r, d in hit_rates(
                json.loads((arm / "before.json").read_text()),
                json.loads((arm / "after.json").read_text())).items()}
        held: dict[str, list[str]] = {}
        if (arm / "status.json").exists():
            try:
                st = json.loads((arm / "status.json").read_text())
                held = {r["replica"]: r.get("adapters") or []
                        for m in st["models"].values() for r in m["per_replica"]}
            except (ValueError, KeyError):
                pass
        loads = sum(d["load"] for d in swaps.values())
        evicts = sum(d["evict"] for d in swaps.values())
        per = []
        for rid in sorted(set(swaps) | set(finished) | set(held)):
            d = swaps.get(rid, dict.fromkeys(EVENTS, 0.0))
            req = finished.get(rid)
            per.append(f"{_short(rid)}: {d['load']:.0f} / {d['evict']:.0f}, "
                       + ("-" if req is None else f"{req:.0f}") + " req, "
                       + (" ".join(held[rid]) or "none" if rid in held else "-"))
        by_policy.setdefault(policy, []).append({
            "ttft": s["ttft_ms"]["median"], "p99": s["ttft_ms"]["p99"],
            "tput": s["output_throughput"], "loads": loads})
        rows.append(
            f"| {n} | {policy} | {s['ttft_ms']['median']:.1f} | {s['ttft_ms']['p99']:.1f} | "
            f"{s['output_throughput']:.0f} | {s['tpot_ms']['median']:.2f} | "
            f"{loads:.0f} / {evicts:.0f} | {'; '.join(per) or '-'} | {s['failed']} |")
    rows.append("")
    mean = lambda arms, k: sum(a[k] for a in arms) / len(arms)  # noqa: E731
    base = by_policy.get("power_of_two")
    for policy, arms in by_policy.items():
        if base is None or policy == "power_of_two":
            continue
        rows.append(
            f"- {policy} / power_of_two ({len(arms)} and {len(base)} arm(s), means): TTFT p50 "
            f"**{mean(arms, 'ttft') / mean(base, 'ttft'):.2f}x**, TTFT p99 "
            f"{mean(arms, 'p99') / mean(base, 'p99'):.2f}x, output throughput "
            f"**{mean(arms, 'tput') / mean(base, 'tput'):.2f}x**, adapter loads per arm "
            f"{mean(base, 'loads'):.0f} -> {mean(arms, 'loads'):.0f}")
    return "\n".join(rows) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("swaps")
    s.add_argument("out", type=Path)
    s.add_argument("--sd", default=SD_FILE)
    for name in ("mix", "affinity"):
        sub.add_parser(name).add_argument("dir", type=Path)
    args = p.parse_args()
    if args.cmd == "swaps":
        args.out.write_text(json.dumps(read_swaps(args.sd), indent=1))
    elif args.cmd == "mix":
        print(mix_table(args.dir), end="")
    else:
        print(affinity_table(args.dir), end="")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
