"""Slow readers: streamed completions whose client reads one byte every ``--read-every`` seconds
through a small receive buffer, to check ``router.stream_stall_timeout_s`` (the router cuts a
stream once one of its writes has waited that long; the tenant metrics count it as 408).

The bytes a response needs before any write of the router waits are the kernel's and HAProxy's
buffers: on loopback through HAProxy about 4 MB per connection (bench/RESULTS.md section 9c), so
point ``--port`` at the router replica's own port to see the cut with outputs past 4 MB (a
socket's send buffer grows to 4 MB: serve_app/bench/slow_client.py).

usage: python bench/slow_reader.py --port PORT [--streams 2] [--n 16] [--max-tokens 2000]
                                  [--model tiny-llama] [--key KEY] [--hold-s 120]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serve_app.bench.slow_client import SLOW_BODY, open_slow_stream  # noqa: E402


async def slow_stream(a: argparse.Namespace, i: int) -> str:
    """One slow reader; returns how it ended as the client saw it."""
    body = {"model": a.model, "prompt": "hello", "max_tokens": a.max_tokens, "n": a.n,
            "ignore_eos": True, "stream": True}
    sock = await open_slow_stream(a.host, a.port, body, a.key)
    t0, got = time.monotonic(), 0
    try:
        while time.monotonic() - t0 < a.hold_s:
            await asyncio.sleep(a.read_every)
            try:
                data = sock.recv(1)
            except BlockingIOError:
                continue
            if not data:
                return f"stream {i}: closed by the server after {time.monotonic() - t0:.1f} s"
            got += 1
        return f"stream {i}: still open after {a.hold_s:.0f} s ({got} bytes read)"
    finally:
        sock.close()


async def main(a: argparse.Namespace) -> None:
    for line in await asyncio.gather(*(slow_stream(a, i) for i in range(a.streams))):
        print(line)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--streams", type=int, default=2)
    p.add_argument("--n", type=int, default=SLOW_BODY["n"],
                   help="choices per request (more bytes per token)")
    p.add_argument("--max-tokens", type=int, default=SLOW_BODY["max_tokens"])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--key", default=None)
    p.add_argument("--read-every", type=float, default=1.0)
    p.add_argument("--hold-s", type=float, default=120.0, help="give up reading after this")
    asyncio.run(main(p.parse_args()))
