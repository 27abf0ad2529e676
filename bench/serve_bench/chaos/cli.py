"""The ``serve-app chaos`` entry: flags, stack lifecycle, scenario order, exit status.

:func:`add_arguments` adds the flags to the ``chaos`` subcommand's parser; :func:`main` starts
the chaos stack (:func:`chaos_config` over ``--config``) through
:func:`serve_app.launch.start_stack`, waits up to 600 s for it to answer and for all its
engine replicas, runs the ``--scenarios`` in the order given (one ``asyncio.run`` each), stops
the stack even when a scenario raised, writes the report under ``--out``, and returns 0 only
if at least one scenario ran and every one passed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from serve_bench.chaos.report import Scenario, write_report
from serve_bench.chaos.scenario_kill import replica_kill
from serve_bench.chaos.scenario_overload import overload
from serve_bench.chaos.scenario_slow import slow_readers
from serve_bench.chaos.scenario_storm import disconnect_storm
from serve_bench.chaos.stack import REPLICAS, STALL_S, chaos_config
from serve_bench.chaos.target import Target, wait_until
from serve_app.config import DEFAULT_CONFIG, load_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="deployment YAML to start from")
    p.add_argument("--port", type=int, default=8010)
    p.add_argument("--out", default="bench/out/chaos")
    p.add_argument("--scenarios", default="storm,kill,overload,slow",
                   help="comma-separated subset of storm, kill, overload, slow")
    p.add_argument("--overload-s", type=float, default=60.0, help="overload duration")
    p.add_argument("--slow-readers", type=int, default=2, help="slow-reader streams")
    p.add_argument("--stall-s", type=float, default=STALL_S,
                   help="router.stream_stall_timeout_s of the chaos stack")


def main(args: argparse.Namespace) -> int:
    import httpx

    from serve_app.launch import start_stack, stop_stack

    cfg, keys = chaos_config(load_config(Path(args.config)), args.port, args.stall_s)
    base = start_stack(cfg, log_to_driver=False)
    scenarios: list[Scenario] = []
    try:
        ok = wait_until(lambda: _ready(httpx, base, keys["chaos-a"]), 600, 1.0)
        if ok is None:
            raise SystemExit("the stack did not become ready in 600 s")
        t = Target(base, keys, cfg.models[0].name)
        wait_until(lambda: len(t.engines()) == REPLICAS, 600, 1.0)
        runs = {"storm": lambda: disconnect_storm(t),
                "kill": lambda: replica_kill(t),
                "overload": lambda: overload(t, duration_s=args.overload_s),
                "slow": lambda: slow_readers(t, args.slow_readers, args.stall_s)}
        for name in args.scenarios.split(","):
            print(f"chaos: {name} ...", flush=True)
            scenario = asyncio.run(runs[name.strip()]())
            print(f"chaos: {scenario.name}: {'PASS' if scenario.passed else 'FAIL'} "
                  f"{json.dumps(scenario.figures)}", flush=True)
            scenarios.append(scenario)
    finally:
        stop_stack()
    command = (f"serve-app chaos --scenarios {args.scenarios} --overload-s {args.overload_s:g} "
               f"--slow-readers {args.slow_readers} --stall-s {args.stall_s:g}")
    print(write_report(Path(args.out), scenarios, command))
    return 0 if scenarios and all(s.passed for s in scenarios) else 1


def _ready(httpx: Any, base: str, key: str) -> bool:
    try:
        return httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {key}"},
                         timeout=5).status_code == 200
    except httpx.HTTPError:
        return False
