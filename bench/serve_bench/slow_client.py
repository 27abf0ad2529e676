"""A client that stops reading a stream: what the stall watch (`serve_app/ingress/stall.py`) is
for. Shared by `make chaos` and the integration test.

The router's writes only wait once the stream has outgrown the socket between it and the client:
on the router replica's own port about 2.2 MB at first, but Linux grows a send buffer up to
4 MB (``tcp_wmem``), and through HAProxy about 4 MB more (bench/RESULTS.md 9c, 9d). So a slow
reader must ask for more than that: :data:`SLOW_BODY` is ~5.3 MB of SSE (n=16 choices of 2,000
tokens; the tiny model's context is 2,048).
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

SLOW_BODY: dict[str, Any] = {"prompt": "hello", "max_tokens": 2000, "n": 16,
                             "ignore_eos": True, "stream": True}
RECEIVE_WINDOW = 2048  # bytes: the client's socket buffer, set before connecting


def request_bytes(host: str, body: dict[str, Any], api_key: str | None) -> bytes:
    """An HTTP/1.1 POST of ``body`` to /v1/completions, as raw bytes for a plain socket."""
    raw = json.dumps(body).encode()
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n{auth}"
            f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n")
    return head.encode() + raw


def small_window_socket() -> socket.socket:
    """A TCP socket with a :data:`RECEIVE_WINDOW` receive buffer (it must be set before
    connecting to shrink the window the server sees)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_WINDOW)
    return sock


async def open_slow_stream(host: str, port: int, body: dict[str, Any],
                           api_key: str | None) -> socket.socket:
    """Connect with a small window and send the request; returns the non-blocking socket,
    nothing read yet (the caller reads as slowly as it likes)."""
    loop = asyncio.get_running_loop()
    sock = small_window_socket()
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, (host, port))
        await loop.sock_sendall(sock, request_bytes(host, body, api_key))
    except BaseException:
        sock.close()
        raise
    return sock
