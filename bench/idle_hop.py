"""One process -> another and back on this host, after a quiet spell: how the first message's
latency grows with the gap before it, for a plain asyncio TCP socket and for a gRPC (grpc.aio)
unary-stream call, the transport under Ray Serve's calls. Serve's own call is
``bench/serve_first_item.py --gaps``.

Why: at c=1 every request follows a quiet spell, and each sleeping thread on the way must be
woken; the fewer threads a hop crosses, the less the quiet costs (bench/RESULTS.md 12e).

usage: python bench/idle_hop.py [--calls 150] [--gaps 0,0.5,2,5,20,50]   (gaps in ms)
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import socket
import statistics
import time

PAYLOAD = b"x" * 6000  # about a 1,024-token request


def _tcp_server(port: int) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await reader.readexactly(len(PAYLOAD))
            writer.write(str(time.monotonic()).encode().ljust(32))

    async def run() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        await server.serve_forever()

    asyncio.run(run())


def _grpc_server(port: int) -> None:
    import grpc

    async def run() -> None:
        async def handler(request: bytes, context: object):
            yield str(time.monotonic()).encode()

        generic = grpc.method_handlers_generic_handler(
            "idle.Hop", {"Call": grpc.unary_stream_rpc_method_handler(handler)})
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((generic,))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(run())


async def _tcp_client(port: int, calls: int, gaps: list[float]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for gap in gaps:
        ins = []
        for _ in range(calls):
            await asyncio.sleep(gap)
            t0 = time.monotonic()
            writer.write(PAYLOAD)
            ins.append((float(await reader.readexactly(32)) - t0) * 1e3)
        print(f"| asyncio TCP | {gap * 1e3:g} | {statistics.median(ins):.3f} |", flush=True)


async def _grpc_client(port: int, calls: int, gaps: list[float]) -> None:
    import grpc

    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    call = channel.unary_stream("/idle.Hop/Call")
    for gap in gaps:
        ins = []
        for _ in range(calls):
            await asyncio.sleep(gap)
            t0 = time.monotonic()
            async for item in call(PAYLOAD):
                ins.append((float(item) - t0) * 1e3)
        print(f"| gRPC (grpc.aio) | {gap * 1e3:g} | {statistics.median(ins):.3f} |", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=150)
    parser.add_argument("--gaps", default="0,0.5,2,5,20,50")
    a = parser.parse_args()
    gaps = [float(g) / 1000 for g in a.gaps.split(",")]
    print("| transport | gap before the call (ms) | call -> handler entered, p50 (ms) |\n"
          "| --- | --- | --- |")
    for server, client in ((_tcp_server, _tcp_client), (_grpc_server, _grpc_client)):
        port = _free_port()
        proc = mp.Process(target=server, args=(port,), daemon=True)
        proc.start()
        time.sleep(1.5)
        try:
            asyncio.run(client(port, a.calls, gaps))
        finally:
            proc.kill()


if __name__ == "__main__":
    main()
