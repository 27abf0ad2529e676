"""A stream whose client left before the first byte still releases what the request held."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import ClientDisconnect

from serve_app.ingress.streaming import GuardedStreamingResponse


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


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
def test_stream_writes_in_the_calling_task_regression_starlette_task_group_delayed_first_byte(spec):
    """Starlette streams a body in a second task of an anyio task group for uvicorn (ASGI spec
    2.3): about 0.9 ms between the router's first chunk and its first write at c=1. The body must
    run in the task that calls the response."""
    caller, in_body = [], []

    async def body():
        in_body.append(asyncio.current_task())
        yield b"data: x\n\n"

    async def send(message):
        pass

    async def receive():
        await asyncio.Event().wait()

    async def main():
        caller.append(asyncio.current_task())
        resp = GuardedStreamingResponse(body(), on_abandon=lambda status: None)
        await resp({**_scope(), "asgi": {"spec_version": spec}}, receive, send)

    asyncio.run(main())
    assert in_body == caller


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
def test_a_client_that_leaves_mid_stream_stops_the_body_while_it_waits_for_the_engine(spec):
    """uvicorn's writes to a closed connection return silently: the disconnect must stop a body
    that is waiting for its next chunk, at once, and release what the request held (499)."""
    closed, calls, sent = [], [], []

    async def main():
        engine_waits = asyncio.Event()
        client_leaves = asyncio.Event()

        async def body():
            try:
                yield b"data: 0\n\n"
                engine_waits.set()
                await asyncio.Event().wait()  # the engine has nothing yet
                yield b"data: 1\n\n"
            finally:
                closed.append(True)

        async def send(message):
            sent.append(message)

        async def receive():
            await client_leaves.wait()
            return {"type": "http.disconnect"}

        resp = GuardedStreamingResponse(body(), on_abandon=calls.append)
        call = asyncio.ensure_future(resp({**_scope(), "asgi": {"spec_version": spec}}, receive, send))
        await engine_waits.wait()
        client_leaves.set()
        await asyncio.wait_for(call, 2)  # returns (the client is gone), raises nothing

    asyncio.run(main())
    assert closed == [True] and calls == [499]
    assert [m.get("body") for m in sent if m["type"] == "http.response.body"] == [b"data: 0\n\n"]


def test_the_disconnect_watch_handed_in_is_used_and_ended():
    """The router hands in the future that watched the client while the request was queued: a
    disconnect it reports stops the stream, and the response ends the watch when it is done."""

    async def main():
        async def body():
            yield b"a"
            await asyncio.Event().wait()
            yield b"b"

        async def send(message):
            pass

        async def receive():  # never used: the handed-in watch reports the disconnect
            raise AssertionError("receive() called")

        gone = asyncio.get_running_loop().create_future()
        calls: list[int] = []
        resp = GuardedStreamingResponse(body(), on_abandon=calls.append, client_gone=gone)
        call = asyncio.ensure_future(resp(_scope(), receive, send))
        await asyncio.sleep(0)
        gone.set_result(None)
        await asyncio.wait_for(call, 2)
        assert calls == [499]

        watch = asyncio.get_running_loop().create_future()

        async def short():
            yield b"a"

        await GuardedStreamingResponse(short(), on_abandon=calls.append, client_gone=watch)(
            _scope(), receive, send)
        assert watch.cancelled()  # a finished response leaves no watch behind

    asyncio.run(main())


def test_a_cancellation_from_outside_still_propagates():
    """Only the client's leaving is swallowed; a shutdown that cancels the response is not."""

    async def main():
        started = asyncio.Event()

        async def body():
            started.set()
            await asyncio.Event().wait()
            yield b"never"

        async def send(message):
            pass

        async def receive():
            await asyncio.Event().wait()

        calls: list[int] = []
        call = asyncio.ensure_future(GuardedStreamingResponse(body(), on_abandon=calls.append)(
            _scope(), receive, send))
        await started.wait()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert calls == [499]

    asyncio.run(main())
