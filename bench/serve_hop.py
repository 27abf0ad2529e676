"""Cost of one streamed item on the Serve hop between the router and an LLMServer replica.

A producer deployment yields ITEMS chunks per stream (one engine step's worth each) as fast as
it can; a consumer deployment reads STREAMS such streams at once through a handle, as the router
does, with Ray Serve's throughput-optimized data plane (gRPC between deployments). Printed: items
per second and microseconds per item, for a chunk sent as the GenerationChunk dataclass and in
its wire form (``GenerationChunk.to_wire``), and ``batched``: one stream whose every item holds
one wire chunk for each of STREAMS requests (what an output channel sends per engine step).
No engine, no HTTP: only the hop.

usage: python bench/serve_hop.py [--streams 1,64,256] [--items 100] [--repeat 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

# Before ray is imported: Serve reads these at import time.
os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")

from ray import serve  # noqa: E402

from serve_app.engine.protocol import ChoiceDelta, GenerationChunk  # noqa: E402

FORMS = ("dataclass", "wire", "batched")


def _chunk() -> GenerationChunk:
    return GenerationChunk([ChoiceDelta(0, " hello", 1)], 128, False)


@serve.deployment(max_ongoing_requests=100_000)
class Producer:
    async def stream(self, items: int, form: str, per_item: int = 1):
        chunk = _chunk()
        for _ in range(items):
            await asyncio.sleep(0)  # one engine step's wake-up per item, as in the replica
            if form == "batched":
                yield [(f"req-{i}", chunk.to_wire()) for i in range(per_item)]
            else:
                yield chunk if form == "dataclass" else chunk.to_wire()


@serve.deployment(max_ongoing_requests=100_000)
class Consumer:
    def __init__(self, producer) -> None:
        self.producer = producer.options(stream=True)

    async def run(self, streams: int, items: int, form: str) -> tuple[int, float]:
        async def one() -> int:
            n = 0
            async for item in self.producer.stream.remote(items, form):
                if form == "wire":
                    GenerationChunk.from_wire(item)  # what the router does with each item
                n += 1
            return n

        async def batched() -> int:
            n = 0
            async for batch in self.producer.stream.remote(items, form, streams):
                for _, wire in batch:
                    GenerationChunk.from_wire(wire)
                    n += 1
            return n

        started = time.perf_counter()
        if form == "batched":
            total = await batched()
        else:
            total = sum(await asyncio.gather(*[one() for _ in range(streams)]))
        return total, time.perf_counter() - started


async def main(streams: list[int], items: int, repeat: int) -> None:
    handle = serve.run(Consumer.bind(Producer.bind()), name="serve-hop", route_prefix=None)
    print("| form | streams | items | items/s | us per item |\n| --- | --- | --- | --- | --- |")
    for _ in range(repeat):
        for form in FORMS:
            for s in streams:
                n, elapsed = await handle.run.remote(s, items, form)
                print(f"| {form} | {s} | {n} | {n / elapsed:,.0f} | {elapsed / n * 1e6:.1f} |",
                      flush=True)
    serve.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="1,64,256")
    parser.add_argument("--items", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=2)
    a = parser.parse_args()
    asyncio.run(main([int(x) for x in a.streams.split(",")], a.items, a.repeat))
