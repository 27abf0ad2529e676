"""A stream whose client left before the first byte still releases what the request held."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import ClientDisconnect

from serve_app.ingress.router import GuardedStreamingResponse


def _scope() -> dict:
    return {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "POST", "path": "/",
            "headers": []}


def test_abandon_runs_when_the_body_generator_never_started():
    started, abandoned = [], []

    async def body():
        started.append(True)
        try:
            yield b"data: x\n\n"
        finally:
            abandoned.append("generator")

    async def send(message):
        raise OSError("client gone")  # fails at http.response.start, before any body

    async def receive():
        return {"type": "http.disconnect"}

    resp = GuardedStreamingResponse(body(), on_abandon=lambda: abandoned.append("guard"))
    with pytest.raises(ClientDisconnect):
        asyncio.run(resp(_scope(), receive, send))
    assert not started and abandoned == ["guard"]


def test_abandon_also_runs_after_a_complete_stream():
    sent, calls = [], []

    async def body():
        yield b"a"
        yield b"b"

    async def send(message):
        sent.append(message)

    async def receive():
        await asyncio.sleep(10)

    resp = GuardedStreamingResponse(body(), on_abandon=lambda: calls.append(1))
    asyncio.run(resp(_scope(), receive, send))
    assert [m.get("body") for m in sent if m["type"] == "http.response.body"][:2] == [b"a", b"b"]
    assert calls == [1]  # the router's callback is idempotent: a no-op after a clean end
