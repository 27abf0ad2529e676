"""Cut streamed responses whose client stopped reading.

A client that reads a stream slowly or not at all (a stuck consumer, a slow-loris reader) is
not a disconnect: its connection stays open, the kernel's and HAProxy's buffers fill (on Linux
defaults about 2 MB on the router's own socket, about 4 MB more through HAProxy), and then the
router's write of the next SSE event waits. Meanwhile the request
holds an admission slot, its engine keeps generating (KV cache, batch place) and the router
buffers what the engine produced. :class:`StallWatch` finds such writes: each streamed response
notes when a write starts and ends (two attribute stores per event, no timer per write), and one
task per router replica looks every ``check_s`` for writes pending longer than the limit and
cancels their response task; the response's cleanup then aborts the engine's work as for a
client that left, and accounts the request as status 408.

Only writes are timed: a stream that waits for its engine (a long prompt, a queue) is not
stalled, and a client that reads one byte a second still blocks the writes once the buffers are
full, so it is cut too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

logger = logging.getLogger(__name__)

Send = Callable[[dict[str, Any]], Awaitable[None]]


class ClientStalled(Exception):
    """Raised out of a response the stall watch cut (the response ends without its body)."""


class _Watched:
    """One streamed response's write state, as the watch reads it."""

    __slots__ = ("task", "writing_since", "stalled")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.writing_since: float | None = None
        self.stalled = False


class StallWatch:
    """The write watchdog of one router replica. ``limit_s``: longest a single write may wait
    for the client; ``cut`` counts the responses it cut (the tenant metrics count them as 408
    through the response's cleanup)."""

    def __init__(self, limit_s: float, check_s: float | None = None) -> None:
        self.limit_s = limit_s
        self.check_s = check_s if check_s is not None else min(1.0, limit_s / 4)
        self._watched: set[_Watched] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self.cut = 0

    def timed(self, send: Send) -> tuple[Send, _Watched]:
        """Wrap ``send`` (called in the task that streams the response): its writes are timed,
        and that task is cancelled when one waits longer than the limit. Call :meth:`done` with
        the returned handle when the response ends."""
        watched = _Watched(asyncio.current_task())  # type: ignore[arg-type]
        self._watched.add(watched)
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._check_forever())

        async def timed_send(message: dict[str, Any]) -> None:
            watched.writing_since = time.monotonic()
            await send(message)
            watched.writing_since = None

        return timed_send, watched

    def done(self, watched: _Watched) -> None:
        self._watched.discard(watched)

    def check(self, now: float | None = None) -> int:
        """Cancel the responses whose pending write is older than the limit; how many."""
        now = time.monotonic() if now is None else now
        cut = 0
        for w in list(self._watched):
            since = w.writing_since
            if since is not None and not w.stalled and now - since > self.limit_s:
                w.stalled = True
                w.task.cancel()
                self._watched.discard(w)
                cut += 1
        self.cut += cut
        return cut

    async def _check_forever(self) -> None:
        while self._watched:
            await asyncio.sleep(self.check_s)
            n = self.check()
            if n:
                logger.warning("cut %d stream(s) whose client accepted nothing for %.0f s", n,
                               self.limit_s)
