"""Latency of the Serve hop a request takes before its first token: router replica -> LLMServer
replica -> first streamed item back, without an engine or HTTP.

A producer deployment records when its method was entered (``time.monotonic``, one host, so the
two processes' clocks agree) and yields that at once; a consumer deployment, as the router does,
calls it through a streaming handle with a GenerationRequest of PROMPT token ids and times the
first item. ``in``: ``.remote()`` -> method entered (the handle's routing, the request's
serialization, the replica's dispatch); ``out``: the yield -> the item at the caller. Variants:
Serve's default request router and the stack's pinned one (serve_app/routing/pinned.py), a
streaming and a unary call, over Serve's gRPC transport and over Ray actor calls
(``_by_reference``).

With ``--gaps`` (ms, e.g. ``0,2,5,20,50``) each call follows that much quiet instead, over gRPC
with the pinned router: the hop after a quiet spell, as a request at c=1 takes it.

usage: python bench/serve_first_item.py [--calls 200] [--prompt 1024] [--gaps 0,2,5,20,50]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

# Before ray is imported: Serve reads these at import time (the stack's data plane).
os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")

from ray import serve  # noqa: E402

from serve_app.bench.stats import percentile  # noqa: E402
from serve_app.engine.protocol import GenerationRequest, SamplingOptions  # noqa: E402
from serve_app.routing.pinned import ROUTER_CLASS  # noqa: E402


@serve.deployment(max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
class Producer:
    async def stream(self, request: GenerationRequest):
        yield time.monotonic()

    async def unary(self, request: GenerationRequest) -> float:
        return time.monotonic()


@serve.deployment(max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
class Consumer:
    def __init__(self, default, pinned) -> None:
        self.handles = {"default": default, "pinned": pinned}

    async def run(self, router: str, kind: str, calls: int, prompt: int, by_reference: bool,
                  gap_s: float = 0.0) -> dict[str, float]:
        handle = self.handles[router].options(_by_reference=by_reference)
        if kind == "stream":
            handle = handle.options(stream=True)
        ins, outs = [], []
        for i in range(calls):
            req = GenerationRequest(f"r{i}", SamplingOptions(), prompt_token_ids=[7] * prompt)
            if gap_s:
                await asyncio.sleep(gap_s)
            t0 = time.monotonic()
            if kind == "stream":
                gen = handle.stream.remote(req)
                entered = await gen.__anext__()
                t1 = time.monotonic()
                async for _ in gen:
                    pass
            else:
                entered = await handle.unary.remote(req)
                t1 = time.monotonic()
            ins.append((entered - t0) * 1000)
            outs.append((t1 - entered) * 1000)
        return {"in": percentile(ins, 50), "out": percentile(outs, 50),
                "total": percentile([a + b for a, b in zip(ins, outs)], 50)}


async def main(calls: int, prompt: int, gaps: list[float]) -> None:
    pinned = Producer.options(name="ProducerPinned",
                              request_router_config={"request_router_class": ROUTER_CLASS})
    handle = serve.run(Consumer.bind(Producer.bind(), pinned.bind()), name="first-item",
                       route_prefix=None)
    if gaps:
        print("| gap before the call (ms) | in p50 ms | out p50 ms |\n| --- | --- | --- |")
        await handle.run.remote("pinned", "stream", calls, prompt, False)  # warm up
        for gap in gaps:
            r = await handle.run.remote("pinned", "stream", calls, prompt, False, gap / 1000)
            print(f"| {gap:g} | {r['in']:.2f} | {r['out']:.2f} |", flush=True)
        serve.shutdown()
        return
    print("| transport | router | call | in p50 ms | out p50 ms | total p50 ms |\n"
          "| --- | --- | --- | --- | --- | --- |")
    for _ in range(2):  # the first round warms connections and code paths
        for by_reference in (False, True):
            transport = "actor call" if by_reference else "gRPC"
            for router in ("default", "pinned"):
                for kind in ("stream", "unary"):
                    r = await handle.run.remote(router, kind, calls, prompt, by_reference)
                    print(f"| {transport} | {router} | {kind} | {r['in']:.2f} | {r['out']:.2f} "
                          f"| {r['total']:.2f} |", flush=True)
    serve.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--gaps", default="", help="ms of quiet before each call, e.g. 0,5,50")
    a = parser.parse_args()
    asyncio.run(main(a.calls, a.prompt, [float(g) for g in a.gaps.split(",") if g]))
