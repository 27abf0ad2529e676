"""``serve-app simulate``: runs :mod:`serve_bench.simulate` per shape and scenario and prints
the table (bench/RESULTS.md section 27), with issue 27's bars checked per row.

Each shape runs with its own simulated length and poll interval (:data:`SHAPES`): at 64 routers
x 256 replicas one ``EngineFeed.apply`` takes 4-5 ms of CPU (the demand reports it merges grow
as routers x replicas: 256 answers of 64 reports each), so the configured 20 ms poll would cost
a real router about a fifth of its core per model, and the simulation 64 times that; that shape
polls every 100 ms and runs 4 simulated seconds, the event at 1 s (about 3 minutes of CPU for
its six scenarios).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from serve_bench.simulate import SCENARIOS, Result, Workload, bars, simulate
from serve_bench.simulate_engine import EngineShape
from serve_app.config import AdmissionSettings

# shape -> (simulated seconds, warm-up seconds, event at, poll interval); --seconds and
# --poll-interval-s override. The event must leave more than POLL_TIMEOUT_S (2 s) before the
# end: a poll with a slow replica in it takes that long.
SHAPES: dict[str, tuple[float, float, float, float]] = {
    "8x32": (20.0, 2.0, 6.0, 0.02),
    "64x256": (4.0, 1.0, 1.0, 0.1),
}


def _shape(text: str) -> tuple[int, int]:
    routers, _, replicas = text.partition("x")
    try:
        return int(routers), int(replicas)
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r}: ROUTERSxREPLICAS, e.g. 8x32") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", action="append", default=None,
                   help=f"ROUTERSxREPLICAS (repeatable; default: {' and '.join(SHAPES)})")
    p.add_argument("--scenario", action="append", choices=SCENARIOS, default=None,
                   help="repeatable; default: all")
    p.add_argument("--seconds", type=float, default=None,
                   help="simulated seconds per scenario (default per shape: "
                   + ", ".join(f"{k} {v[0]:g}" for k, v in SHAPES.items()) + ")")
    p.add_argument("--poll-interval-s", type=float, default=None,
                   help="the routers' load poll period (default per shape: "
                   + ", ".join(f"{k} {v[3]:g}" for k, v in SHAPES.items()) + ")")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help=f"each engine's batch places (default {EngineShape.max_num_seqs})")
    p.add_argument("--step-tokens", type=int, default=None,
                   help=f"each engine step's token budget (default {EngineShape.step_tokens})")
    p.add_argument("--flood-in-out", default=None, metavar="IN/OUT",
                   help=f"flood prompt and mean output tokens (default "
                   f"{Workload.flood_prompt}/{Workload.flood_output})")
    p.add_argument("--report-ttl-s", type=float, default=None,
                   help="how long a router's demand report counts on a replica (default: the "
                   "LLMServer's, engine/router_reports.py); to see what another would change")
    p.add_argument("--no-channel-goodbye", action="store_true",
                   help="a router that dies leaves its report until the TTL (as with output "
                   "channels off) instead of being forgotten when its channels close")
    p.add_argument("--jobs", type=int, default=1, help="scenarios run in parallel processes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results to this file")


Job = tuple[int, int, str, float, float, float, float, int, EngineShape, Workload,
            "float | None", bool]


def _one(job: Job) -> Result:
    (routers, replicas, scenario, seconds, warmup, event, poll, seed, shape, workload, ttl,
     goodbye) = job
    return simulate(routers, replicas, scenario, seconds=seconds, warmup_s=warmup, event_s=event,
                    settings=AdmissionSettings(poll_interval_s=poll), seed=seed, shape=shape,
                    workload=workload, report_ttl_s=ttl, channel_goodbye=goodbye)


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.0f}"


def table(results: list[Result]) -> str:
    """The markdown table of ``results`` (one row per shape x scenario)."""
    head = ("| shape | scenario | util. mean (worst 1 s) | engine waiting mean / worst "
            "replica / max (headroom) | engine waiting worst 1 s (bar) | quiet wait p50/p99 ms | quiet TTFT p50/p99 ms (n) | "
            "sent to draining | failed / 429 | apply ms (views/s per router) | bars |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        ok = bars(r)
        missed = [k for k, v in ok.items() if not v]
        rows.append(
            f"| {r.routers}x{r.replicas} | {r.scenario} | {100 * r.util_mean:.1f}% "
            f"({100 * r.util_min_1s:.1f}%) | {r.waiting_mean:.2f} / {r.waiting_worst:.2f} / "
            f"{r.waiting_max} ({r.headroom}) | {r.waiting_worst_1s:.2f} "
            f"({r.headroom + r.step_worth}) | {_ms(r.quiet_wait_p50_ms)}/"
            f"{_ms(r.quiet_wait_p99_ms)} | {_ms(r.quiet_ttft_p50_ms)}/"
            f"{_ms(r.quiet_ttft_p99_ms)} ({r.quiet_n}) | {r.sent_to_draining} | "
            f"{r.failed} / {r.rejected} | {r.apply_ms:.2f} ({r.polls_per_s:.0f}) | "
            f"{'all hold' if not missed else 'MISSED: ' + ', '.join(missed)} |")
    return "\n".join(rows)


def run(args: argparse.Namespace) -> int:
    jobs: list[Job] = []
    shape = EngineShape()
    if args.max_num_seqs or args.step_tokens:
        shape = dataclasses.replace(shape, max_num_seqs=args.max_num_seqs or shape.max_num_seqs,
                                    step_tokens=args.step_tokens or shape.step_tokens)
        shape = dataclasses.replace(shape, kv_tokens=shape.max_num_seqs * 4096)
    workload = Workload()
    if args.flood_in_out:
        prompt, _, output = args.flood_in_out.partition("/")
        workload = dataclasses.replace(workload, flood_prompt=int(prompt),
                                       flood_output=int(output))
    for text in args.shape or list(SHAPES):
        routers, replicas = _shape(text)
        seconds, warmup, event, poll = SHAPES.get(text, SHAPES["8x32"])
        if args.seconds:
            seconds = args.seconds
            warmup = min(warmup, seconds / 4)
            event = max(warmup, seconds / 3)
        poll = args.poll_interval_s or poll
        for scenario in args.scenario or SCENARIOS:
            jobs.append((routers, replicas, scenario, seconds, warmup, event, poll, args.seed,
                         shape, workload, args.report_ttl_s, not args.no_channel_goodbye))
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            results = list(pool.map(_one, jobs))
    else:
        results = [_one(job) for job in jobs]
    print(table(results))
    for r, job in zip(results, jobs):
        print(f"{r.routers}x{r.replicas} {r.scenario}: {job[3]:g} s simulated (measured from "
              f"{job[4]:g} s, event at {job[5]:g} s), poll every {job[6]:g} s, "
              f"{r.flood_done} flood requests done, "
              f"{r.cpu_s:.1f} s CPU")
    if args.json:
        out: list[dict[str, Any]] = [asdict(r) | {"bars": bars(r)} for r in results]
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1))
    return 0 if all(all(bars(r).values()) for r in results) else 1


__all__ = ["SHAPES", "add_arguments", "run", "table"]
