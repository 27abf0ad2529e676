"""c=1 TTFT of the stack on the CPU (tiny model, real vLLM CPU engine) with its Server-Timing
phases, with the router's direct start on or off: requests one at a time, each after a quiet gap,
as a lone interactive user sends them. Compare the arms by their phases (``hop_in`` moves by
milliseconds; whole-request TTFT on a 2-core machine drifts between runs).

usage: python bench/stack_ttft_cpu.py on|off [--requests 60] [--rounds 2] [--gap-ms 50]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from serve_app.config import load_config  # noqa: E402
from serve_app.engine.timing import PHASES, parse_server_timing  # noqa: E402
from serve_app.launch import start_stack, stop_stack, wait_until_serving  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("direct", choices=["on", "off"])
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--gap-ms", type=float, default=50)
    parser.add_argument("--config", default=str(REPO / "deployments" / "local-cpu.yaml"))
    a = parser.parse_args()
    cfg = load_config(a.config)
    router = cfg.router.model_copy(update={"server_timing": True,
                                           "direct_start": a.direct == "on"})
    cfg = cfg.model_copy(update={"router": router})
    model = cfg.models[0].name
    base = start_stack(cfg, num_cpus=4)
    try:
        wait_until_serving(base)
        body = {"model": model, "prompt": [11] * 128, "max_tokens": 4, "stream": True}
        print("| direct start | round | TTFT p50 (ms) | " + " | ".join(PHASES) + " |")
        print("| --- " * (3 + len(PHASES)) + "|")
        with httpx.Client(timeout=60) as client:
            for rnd in range(a.rounds):
                ttfts, phases = [], []
                for _ in range(a.requests):
                    time.sleep(a.gap_ms / 1000)
                    t0 = time.perf_counter()
                    with client.stream("POST", base + "/v1/completions", json=body) as r:
                        r.raise_for_status()
                        lines = r.iter_lines()
                        for line in lines:
                            if line.startswith("data: {"):
                                ttfts.append((time.perf_counter() - t0) * 1e3)
                                phases.append(parse_server_timing(r.headers.get("server-timing")))
                                break
                        for _ in lines:
                            pass
                med = [statistics.median(p.get(k, float("nan")) for p in phases) for k in PHASES]
                print(f"| {a.direct} | {rnd} | {statistics.median(ttfts):.2f} | "
                      + " | ".join(f"{m:.2f}" for m in med) + " |", flush=True)
    finally:
        stop_stack()


if __name__ == "__main__":
    main()
