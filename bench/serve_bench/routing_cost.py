"""The router's CPU per routing decision, by body size (issue 38, "a bounded hot path").

For text prompts and chat conversations of 1 KB to 2 MB, times what the request router asks of
the policy for one request (``key`` then ``choose``, two replicas), in the router's process,
without Serve around it:

* ``prefix_affinity``: the key of the leading blocks (a chat's messages joined into one text on
  every attempt, then cut);
* ``prefix_cache`` first attempt: the chained block hashes (at most ``max_blocks``) and the walk
  of the index, with the whole prompt cached on one replica (the longest walk);
* ``prefix_cache`` later attempt: the hashes read back from the request, and the walk;
* the serving replica's record of the request's hashes (``ServedBlocks.record``), for scale.

    python -m serve_bench.routing_cost [--repeat 200] [--sizes 1000,10000,...] [--json OUT]

Each figure is the median over ``--repeat`` runs of one call (``time.perf_counter_ns``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

from serve_app.engine.protocol import EngineLoad, GenerationRequest, SamplingOptions
from serve_app.engine.server import ServedBlocks
from serve_app.routing import build_policy
from serve_app.routing.policy import Candidate
from serve_app.routing.prefix_index import PrefixIndex, index_for

SIZES = (1_000, 10_000, 100_000, 400_000, 1_000_000, 2_000_000)
MESSAGE_CHARS = 2_000  # a chat turn's size in the chat bodies


def _request(shape: str, size: int) -> GenerationRequest:
    if shape == "text":
        return GenerationRequest("r", SamplingOptions(), prompt="x" * size, cache_salt="t")
    messages = [{"role": "system", "content": "s" * MESSAGE_CHARS}]
    while sum(len(m["content"]) for m in messages) < size:
        role = "user" if len(messages) % 2 else "assistant"
        messages.append({"role": role, "content": f"{len(messages)} " + "m" * MESSAGE_CHARS})
    return GenerationRequest("r", SamplingOptions(), messages=messages, cache_salt="t")


def _median_us(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1000


def measure(sizes: tuple[int, ...] = SIZES, repeat: int = 200) -> list[dict[str, Any]]:
    """One row per (shape, size): microseconds per decision of each variant."""
    affinity = build_policy("prefix_affinity")
    cache = build_policy("prefix_cache", "routing-cost")
    index: PrefixIndex = index_for("routing-cost")
    cands = [Candidate("a", 3), Candidate("b", 3)]
    rows = []
    for shape in ("text", "chat"):
        for size in sizes:
            request = _request(shape, size)
            # The whole prompt (its hashed blocks) cached on replica a: the longest walk.
            served = ServedBlocks(1_000_000)
            cache.key(request)
            hashes = request.prefix_hashes or ()
            served.record(hashes)
            index.keep(())
            index.apply([EngineLoad(0, 0, replica="a", prefix_report=served.report(None)),
                         EngineLoad(0, 0, replica="b")])

            def first() -> None:
                request.prefix_hashes = None
                cache.choose(cache.key(request), cands)

            rows.append({
                "shape": shape, "body_bytes": size, "blocks": len(hashes),
                "prefix_affinity_us": _median_us(
                    lambda: affinity.choose(affinity.key(request), cands), repeat),
                "prefix_cache_first_us": _median_us(first, repeat),
                "prefix_cache_again_us": _median_us(
                    lambda: cache.choose(cache.key(request), cands), repeat),
                "replica_record_us": _median_us(lambda: served.record(hashes), repeat),
            })
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| body | size | blocks hashed | prefix_affinity (us) | prefix_cache, first "
             "attempt (us) | prefix_cache, later attempt (us) | replica's record (us) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['body_bytes'] / 1000:g} KB | {r['blocks']} | "
                     f"{r['prefix_affinity_us']:.1f} | {r['prefix_cache_first_us']:.1f} | "
                     f"{r['prefix_cache_again_us']:.1f} | {r['replica_record_us']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=200)
    p.add_argument("--sizes", default=",".join(map(str, SIZES)))
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)
    rows = measure(tuple(int(s) for s in args.sizes.split(",")), args.repeat)
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
