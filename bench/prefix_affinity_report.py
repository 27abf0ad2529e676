"""Helpers of bench/gpu_prefix_affinity.sh: read the engines' counters around a run, sample the
replicas' load during it, and write the comparison table.

    python bench/prefix_affinity_report.py scrape OUT.json [--sd FILE] [--min-finished N]
        vLLM's prefix-cache queries and hits (tokens) and finished requests, per engine replica
        (label ReplicaId), and the routers' decisions by reason (``decision:REASON`` under each
        router replica), summed over every Ray metrics agent the service-discovery file names;
        with --min-finished, read again until the replicas have finished N requests in all
        (Ray's agents export what the engines counted seconds ago: read at once, the last
        requests of a run were missing)
    python bench/prefix_affinity_report.py sample OUT.json --address ADDR [--interval-s 1]
        every interval until SIGTERM/SIGINT: each engine replica's running and waiting requests
        (serve-app status, the router's engine feed), one sample per line of OUT.json
    python bench/prefix_affinity_report.py record OUT.json --address ADDR --model MODEL
        each engine replica's record-error counters (LLMServer.prefix_record_stats: how well
        prefix_cache's LRU record of served blocks predicted the engine's cached tokens),
        summed over the replicas; zeros under policies that send no block hashes
    python bench/prefix_affinity_report.py table DIR
        the markdown summary of every arm under DIR (DIR/ARM/{results.json, before.json,
        after.json, load.jsonl}), pairs of policies per workload with their ratios
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterable

SD_FILE = "/tmp/ray/prom_metrics_service_discovery.json"  # Ray's default temp dir
COUNTERS = {"queries": "ray_vllm_prefix_cache_queries_total",
            "hits": "ray_vllm_prefix_cache_hits_total",
            "finished": "ray_vllm_request_success_total"}
# The request routers' decisions by reason (serve_app.routing.policy.REASONS): why the policy
# sent a request where it did; a prefix policy that loses hit rate shows it here (load_fallback).
DECISIONS = "ray_serve_app_routing_decisions_total"
_REASON = re.compile(r'reason="([^"]*)"')
_LINE = re.compile(r"^(\w+)\{([^}]*)\}\s+([0-9.eE+-]+|NaN)$")
_REPLICA = re.compile(r'ReplicaId="([^"]*)"')


def parse_counters(text: str) -> dict[str, dict[str, float]]:
    """ReplicaId -> {queries, hits, finished} from a Prometheus text page (summed over the
    other labels), and ``decision:REASON`` for a router replica's routing decisions. Series
    without a ReplicaId (a bare vLLM) count under ""."""
    wanted = {name: key for key, name in COUNTERS.items()}
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if not m or (m.group(1) not in wanted and m.group(1) != DECISIONS):
            continue
        if m.group(1) == DECISIONS:
            reason = _REASON.search(m.group(2))
            key = f"decision:{reason.group(1) if reason else ''}"
        else:
            key = wanted[m.group(1)]
        rid = _REPLICA.search(m.group(2))
        per = out.setdefault(rid.group(1) if rid else "", dict.fromkeys(COUNTERS, 0.0))
        per[key] = per.get(key, 0.0) + float(m.group(3))
    return out


def scrape(out: Path, sd_file: str, min_finished: float = 0, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        total = read_counters(sd_file)
        finished = sum(c["finished"] for c in total.values())
        if finished >= min_finished or time.monotonic() > deadline:
            break
        time.sleep(2)  # Ray's agents export on their own period (seconds)
    if finished < min_finished:
        print(f"{out}: {finished:.0f} requests finished, expected {min_finished:.0f}; "
              "written as read", file=sys.stderr)
    out.write_text(json.dumps(total, indent=1))


def read_agents(sd_file: str, parse: Callable[[str], dict[str, dict[str, float]]],
                keys: Iterable[str]) -> dict[str, dict[str, float]]:
    """``parse`` (a metrics page -> replica -> {key: value}) of every metrics agent that Ray's
    service-discovery file ``sd_file`` names, summed per replica and key (one read); each
    replica starts from 0 for every one of ``keys``."""
    targets = [t for group in json.loads(Path(sd_file).read_text()) for t in group["targets"]]
    total: dict[str, dict[str, float]] = {}
    for target in targets:
        try:
            text = urllib.request.urlopen(f"http://{target}/metrics", timeout=10).read().decode()
        except OSError as err:
            print(f"cannot scrape {target}: {err}", file=sys.stderr)
            continue
        for rid, counts in parse(text).items():
            per = total.setdefault(rid, dict.fromkeys(keys, 0.0))
            for k, v in counts.items():
                per[k] = per.get(k, 0.0) + v
    return total


def read_counters(sd_file: str) -> dict[str, dict[str, float]]:
    """The counters of every metrics agent, per replica (one read)."""
    return read_agents(sd_file, parse_counters, COUNTERS)


def sample(out: Path, address: str, interval_s: float) -> None:
    from serve_app.launch import status

    stop = {"now": False}

    def on_signal(*_: object) -> None:
        stop["now"] = True

    with out.open("w") as f:
        while not stop["now"]:
            try:
                s = status(address=address)
                # ray.init (in the first status call) puts its own handlers in place.
                signal.signal(signal.SIGTERM, on_signal)
                signal.signal(signal.SIGINT, on_signal)
                row = {m: {r["replica"]: [r["running"], r["waiting"]] for r in v["per_replica"]}
                       for m, v in s["models"].items()}
                f.write(json.dumps({"t": time.time(), "models": row}) + "\n")
                f.flush()
            except Exception as err:  # a sample missed is not a run lost
                print(f"status failed: {err}", file=sys.stderr)
            time.sleep(interval_s)


def record(out: Path, address: str, model: str) -> None:
    import asyncio

    import ray
    from ray import serve

    from serve_app.app import APP_NAME, llm_server_name
    from serve_app.serve_private import broadcast_each

    ray.init(address=address, log_to_driver=False)
    handle = serve.get_deployment_handle(llm_server_name(model), app_name=APP_NAME)
    answers = asyncio.run(broadcast_each(handle, "prefix_record_stats", timeout_s=30))
    total: dict[str, float] = {}
    for a in answers:
        if isinstance(a, dict):
            for k, v in a.items():
                total[k] = total.get(k, 0.0) + v
    out.write_text(json.dumps(total, indent=1))


def record_error(before: dict[str, float], after: dict[str, float]) -> str:
    """The record's prediction over a run: predicted and engine-cached shares of the prompt
    tokens and the mean absolute error per request, as the table's cell ("-": none)."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    if not d.get("requests") or not d.get("prompt_tokens"):
        return "-"
    return (f"{d['predicted_tokens'] / d['prompt_tokens']:.2f} / "
            f"{d['cached_tokens'] / d['prompt_tokens']:.2f}, "
            f"{d['abs_error_tokens'] / d['requests']:.0f} tok")


def hit_rates(before: dict[str, Any], after: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per replica over the run: hit rate, queries, hits and requests finished (after - before)."""
    out = {}
    for rid, a in after.items():
        b = before.get(rid, dict.fromkeys(COUNTERS, 0.0))
        d = {k: a[k] - b.get(k, 0.0) for k in COUNTERS}
        d["hit_rate"] = d["hits"] / d["queries"] if d["queries"] else float("nan")
        out[rid] = d
    return out


def decisions(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """The routers' decisions over the run, by reason (after - before, summed over routers)."""
    out: dict[str, float] = {}
    for rid, a in after.items():
        for key, v in a.items():
            if key.startswith("decision:"):
                reason = key.partition(":")[2]
                out[reason] = out.get(reason, 0.0) + v - before.get(rid, {}).get(key, 0.0)
    return {reason: n for reason, n in sorted(out.items()) if n}


def load_balance(lines: list[str]) -> tuple[dict[str, float], float]:
    """Mean running requests per replica over the samples that saw any work, and the ratio of
    the busiest replica's mean to the least busy one's (inf when one ran nothing)."""
    sums: dict[str, float] = {}
    n = 0
    for line in lines:
        row = json.loads(line)
        for replicas in row["models"].values():
            if not any(r for r, _ in replicas.values()):
                continue
            n += 1
            for rid, (running, _waiting) in replicas.items():
                sums[rid] = sums.get(rid, 0.0) + running
    means = {rid: v / max(n, 1) for rid, v in sums.items()}
    if len(means) < 2:
        return means, float("nan")
    lo, hi = min(means.values()), max(means.values())
    return means, (hi / lo if lo else float("inf"))


def table(root: Path) -> str:
    rows = ["| workload | policy | TTFT p50 (ms) | TTFT p99 (ms) | out tok/s | hit rate "
            "(all) | ceiling | record predicted / cached, mean abs error | hit rate per "
            "replica | requests per replica | mean running per replica (max/min) | routing "
            "decisions | failed |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    by_workload: dict[str, dict[str, dict[str, float]]] = {}
    for arm in sorted(p for p in root.iterdir() if (p / "results.json").exists()):
        workload, _, policy = arm.name.partition("--")
        run = json.loads((arm / "results.json").read_text())["runs"][-1]
        s = run["summary"]
        ceiling = run.get("prefix_ceiling")
        err = "-"
        if (arm / "record-before.json").exists() and (arm / "record-after.json").exists():
            err = record_error(json.loads((arm / "record-before.json").read_text()),
                               json.loads((arm / "record-after.json").read_text()))
        before = json.loads((arm / "before.json").read_text())
        after = json.loads((arm / "after.json").read_text())
        rates = hit_rates(before, after)
        reasons = decisions(before, after)
        rates = {rid: d for rid, d in rates.items() if d["queries"] > 0}
        queries = sum(d["queries"] for d in rates.values())
        overall = sum(d["hits"] for d in rates.values()) / queries if queries else float("nan")
        load_file = arm / "load.jsonl"
        means, ratio = load_balance(load_file.read_text().splitlines()
                                    if load_file.exists() else [])
        by_workload.setdefault(workload, {})[policy] = {
            "ttft": s["ttft_ms"]["median"], "tput": s["output_throughput"], "hit": overall,
            "ratio": ratio}
        rows.append(
            f"| {workload} | {policy} | {s['ttft_ms']['median']:.1f} | "
            f"{s['ttft_ms']['p99']:.1f} | {s['output_throughput']:.0f} | {overall:.3f} | "
            + ("-" if ceiling is None else f"{ceiling:.3f}") + f" | {err} | "
            + ", ".join(f"{d['hit_rate']:.2f}" for d in rates.values()) + " | "
            + ", ".join(f"{d['finished']:.0f}" for d in rates.values()) + " | "
            + ", ".join(f"{v:.1f}" for v in means.values()) + f" ({ratio:.2f}) | "
            + (", ".join(f"{r} {n:.0f}" for r, n in reasons.items()) or "-") + " | "
            f"{s['failed']} |")
    rows.append("")
    for workload, arms in by_workload.items():
        base = arms.get("power_of_two")
        for policy, new in arms.items():
            if base is None or policy == "power_of_two":
                continue
            rows.append(f"- {workload}: {policy} / power_of_two: TTFT p50 "
                        f"**{new['ttft'] / base['ttft']:.2f}x**, output throughput "
                        f"**{new['tput'] / base['tput']:.2f}x**, hit rate {base['hit']:.2f} -> "
                        f"{new['hit']:.2f}, running max/min {base['ratio']:.2f} -> "
                        f"{new['ratio']:.2f}")
    return "\n".join(rows) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("scrape")
    s.add_argument("out", type=Path)
    s.add_argument("--sd", default=SD_FILE)
    s.add_argument("--min-finished", type=float, default=0)
    s = sub.add_parser("sample")
    s.add_argument("out", type=Path)
    s.add_argument("--address", default="auto")
    s.add_argument("--interval-s", type=float, default=0.5)
    s = sub.add_parser("record")
    s.add_argument("out", type=Path)
    s.add_argument("--address", default="auto")
    s.add_argument("--model", required=True)
    s = sub.add_parser("table")
    s.add_argument("dir", type=Path)
    args = p.parse_args()
    if args.cmd == "scrape":
        scrape(args.out, args.sd, args.min_finished)
    elif args.cmd == "sample":
        sample(args.out, args.address, args.interval_s)
    elif args.cmd == "record":
        record(args.out, args.address, args.model)
    else:
        print(table(args.dir), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
