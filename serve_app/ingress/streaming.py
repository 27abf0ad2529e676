"""The streaming response of the router: Starlette's, made to release what a request holds
however its stream ends, and to cut a client that stopped reading."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable

from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect

from serve_app.ingress.http import disconnected
from serve_app.ingress.stall import ClientStalled, StallWatch


class GuardedStreamingResponse(StreamingResponse):
    """A StreamingResponse that calls ``on_abandon`` when it is done sending, however that went.

    A client that leaves before the first byte can make Starlette cancel the response before
    it ever starts the body generator; a generator that never started never runs its
    ``finally``, which would leave the engine generating and the admission slot held.
    ``on_abandon(status)`` must be idempotent (the generator's own cleanup usually ran
    already); its status is 408 when the stall watch cut a client that stopped reading, 499
    otherwise.

    The body streams in the task that calls the response, and a client that leaves cancels it
    (``client_gone``: a future that completes on the client's disconnect, e.g. the one that
    watched it while the request was queued; else one is started on ``receive``). Starlette's
    own response, for ASGI servers before spec 2.4 (uvicorn's), streams in a second task beside
    a disconnect listener in an anyio task group: about 0.9 ms between the first chunk and its
    first write at c=1 on a 2-core machine (bench/RESULTS.md 12d), on every request's TTFT."""

    def __init__(self, content: AsyncIterator[bytes], *, on_abandon: Callable[[int], None],
                 stall_watch: StallWatch | None = None,
                 client_gone: asyncio.Future[Any] | None = None, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_abandon = on_abandon
        self._stall_watch = stall_watch
        self._client_gone = client_gone

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        status = 499
        task = asyncio.current_task()
        assert task is not None
        gone = self._client_gone or asyncio.ensure_future(disconnected(receive))
        streaming = True
        left = False

        def client_left(fut: asyncio.Future[Any]) -> None:
            # Runs between the task's steps: while `streaming`, the task waits at an await
            # inside stream_response, where the cancellation arrives.
            nonlocal left
            if streaming and not fut.cancelled():
                left = True
                task.cancel()

        gone.add_done_callback(client_left)
        try:
            await self.stream_response(send)
            streaming = False
        except ClientStalled:
            status = 408  # cut on purpose: the connection closes without the rest of the body
        except asyncio.CancelledError:
            if not left or task.uncancel() > 0:
                raise  # cancelled from outside (shutdown), not by the client leaving
        except OSError:  # ASGI servers of spec 2.4 raise on writes to a closed connection
            raise ClientDisconnect() from None
        finally:
            streaming = False
            gone.remove_done_callback(client_left)
            gone.cancel()
            self._on_abandon(status)

    async def stream_response(self, send: Any) -> None:
        """Starlette's, with each write timed by the stall watch (if any): a client that takes
        nothing for ``router.stream_stall_timeout_s`` is cut (:mod:`serve_app.ingress.stall`)."""
        if self._stall_watch is None:
            return await super().stream_response(send)
        timed_send, watched = self._stall_watch.timed(send)
        try:
            await super().stream_response(timed_send)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not watched.stalled or task is None:
                raise
            task.uncancel()  # our own cut, not a cancellation of the whole response
            raise ClientStalled() from None
        finally:
            self._stall_watch.done(watched)
