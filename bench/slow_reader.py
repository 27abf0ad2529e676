"""Slow readers: streamed completions whose client reads one byte every ``--read-every`` seconds
through a small receive buffer, to check ``router.stream_stall_timeout_s`` (the router cuts a
stream once one of its writes has waited that long; the tenant metrics count it as 408).

The bytes a response needs before any write of the router waits are the kernel's and HAProxy's
buffers: on loopback through HAProxy about 4 MB per connection (bench/RESULTS.md section 9c), so
point ``--port`` at the router replica's own port to see the cut with outputs of a few MB.

usage: python bench/slow_reader.py --port PORT [--streams 2] [--n 16] [--max-tokens 1500]
                                  [--model tiny-llama] [--key KEY] [--hold-s 120]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import time


async def slow_stream(a: argparse.Namespace, i: int) -> str:
    """One slow reader; returns how it ended as the client saw it."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # before connect: small window
    sock.setblocking(False)
    await loop.sock_connect(sock, (a.host, a.port))
    body = json.dumps({"model": a.model, "prompt": "hello", "max_tokens": a.max_tokens,
                       "n": a.n, "ignore_eos": True, "stream": True}).encode()
    auth = f"Authorization: Bearer {a.key}\r\n" if a.key else ""
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {a.host}\r\n{auth}"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    await loop.sock_sendall(sock, head.encode() + body)
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
    p.add_argument("--n", type=int, default=16, help="choices per request (more bytes per token)")
    p.add_argument("--max-tokens", type=int, default=1500)
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--key", default=None)
    p.add_argument("--read-every", type=float, default=1.0)
    p.add_argument("--hold-s", type=float, default=120.0, help="give up reading after this")
    asyncio.run(main(p.parse_args()))
