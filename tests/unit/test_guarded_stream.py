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

    resp = GuardedStreamingResponse(body(), on_abandon=lambda status: abandoned.append("guard"))
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

    resp = GuardedStreamingResponse(body(), on_abandon=lambda status: calls.append(1))
    asyncio.run(resp(_scope(), receive, send))
    assert [m.get("body") for m in sent if m["type"] == "http.response.body"][:2] == [b"a", b"b"]
    assert calls == [1]  # the router's callback is idempotent: a no-op after a clean end


@pytest.mark.parametrize("spec", ["2.3", "2.4"])  # Starlette's task-group path and direct path
def test_a_stream_whose_client_takes_nothing_is_cut_and_released(spec):
    """Slow readers: a client that stops reading blocks the router's write of the next event;
    the stall watch cuts the response after its limit, and the request's cleanup runs (engine
    abort, slot release), while a stream whose client reads is left alone."""
    from serve_app.ingress.stall import StallWatch

    async def main():
        watch = StallWatch(limit_s=0.3, check_s=0.05)
        calls: list[str] = []
        forever = asyncio.Event()

        def body():
            async def gen():
                for i in range(1000):
                    yield b"data: %d\n\n" % i
                    await asyncio.sleep(0.01)
            return gen()

        async def stuck_send(message):
            if message.get("body") == b"data: 3\n\n":
                await forever.wait()  # the client's window is shut: this write never completes

        async def reading_send(message):
            pass

        async def receive():
            await forever.wait()

        scope = {**_scope(), "asgi": {"spec_version": spec}}
        stuck = GuardedStreamingResponse(body(), on_abandon=lambda status: calls.append(("stuck", status)),
                                         stall_watch=watch)
        reader = GuardedStreamingResponse(body(), on_abandon=lambda status: calls.append(("reader", status)),
                                          stall_watch=watch)
        t0 = asyncio.get_running_loop().time()
        reading = asyncio.ensure_future(reader(scope, receive, reading_send))
        await asyncio.wait_for(stuck(scope, receive, stuck_send), 5)
        elapsed = asyncio.get_running_loop().time() - t0
        assert calls == [("stuck", 408)] and watch.cut == 1
        assert 0.3 < elapsed < 2.0
        assert not reading.done()  # the other stream goes on
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading

    asyncio.run(main())
