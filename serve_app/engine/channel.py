"""Output channels: one Serve stream per (router replica, engine replica) that carries every
token chunk of that router's requests on this replica, batched per event-loop pass.

Why: each item of a Serve stream is one gRPC message, and each message costs about 30 us of
CPU on both ends whatever it holds (``bench/serve_hop.py``: 31 us per item one stream per
request, 1.4 us per item batched). With a stream per request, 256 streams cost the replica
~8 ms per engine step on top of vLLM's own output processing, and its event loop fell behind:
vLLM merged the deltas it could not hand over, and clients saw a chunk every 4-5 steps (ITL
p50 58.6 ms against 12.0 ms bare at c=256, bench/RESULTS.md section 1b). A channel sends what
all requests of one router produced in one pass of the loop as one message.

Contract (the replica side; :mod:`serve_app.ingress.channels` is the router side):
* A request's first chunk still goes back on its own Serve stream (errors before it are real
  HTTP status codes, and it tells the router which replica serves the request). Its later
  chunks are :meth:`OutputChannels.push`-ed here, tagged with the request id, in order.
* The request's own stream stays open until the engine is done with it, so Serve still counts
  it (drain, ``max_ongoing_requests``) and cancelling it still aborts the engine's work.
* :meth:`OutputChannels.stream` is the body of one channel; its first batch is empty (the
  channel is open: the router never cancels an open channel, which could lose a batch).
  Chunks pushed while a router has no channel open wait here until it opens one. A newer
  channel of the same router replaces the older (which returns), so one router never reads
  one outbox from two streams (order).
* A channel ends by itself once its router has had nothing in flight here for ``idle_s``:
  a draining replica must reach zero ongoing Serve requests to stop.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

# A channel with nothing to carry and no request of its router in flight ends after this long.
CHANNEL_IDLE_S = 5.0
# Chunks of finished requests wait this long for their router to open a channel; a router that
# went away never will.
UNCLAIMED_TTL_S = 60.0

Batch = list[tuple[str, Any]]  # (request id, wire chunk) in the order they were pushed


class _Outbox:
    __slots__ = ("items", "ready", "active", "generation", "readers", "touched")

    def __init__(self) -> None:
        self.items: Batch = []
        self.ready = asyncio.Event()
        self.active = 0  # this router's requests whose chunks come through here
        self.generation = 0  # which open channel of this router is the current one
        self.readers = 0  # channels of this router open here (the current one and older ones)
        self.touched = time.monotonic()  # when its last request ended (or it was made)


class OutputChannels:
    """The replica's outboxes, one per router replica."""

    def __init__(self, idle_s: float = CHANNEL_IDLE_S) -> None:
        self.idle_s = idle_s
        self._boxes: dict[str, _Outbox] = {}

    def _box(self, router: str) -> _Outbox:
        box = self._boxes.get(router)
        if box is None:
            box = self._boxes[router] = _Outbox()
        return box

    def begin(self, router: str) -> None:
        """A request of ``router`` will push chunks (keeps the router's channel open)."""
        self._box(router).active += 1
        if len(self._boxes) > 1:
            self._drop_unclaimed()

    def _drop_unclaimed(self) -> None:
        now = time.monotonic()
        for name, box in list(self._boxes.items()):
            if box.readers == 0 and box.active <= 0 and now - box.touched > UNCLAIMED_TTL_S:
                del self._boxes[name]

    def end(self, router: str) -> None:
        """That request is done with the engine (finished, failed or cancelled)."""
        box = self._boxes.get(router)
        if box is not None:
            box.active -= 1
            box.touched = time.monotonic()
            if box.active <= 0:
                box.ready.set()  # lets an idle channel start its idle timer
                if box.readers == 0 and not box.items:
                    del self._boxes[router]

    def push(self, router: str, request_id: str, wire: Any) -> None:
        """Queue one chunk of ``request_id`` for ``router`` (no await: called per chunk)."""
        box = self._box(router)
        box.items.append((request_id, wire))
        box.ready.set()

    def pending(self, router: str) -> int:
        """Chunks waiting for ``router`` to read them (tests, diagnostics)."""
        box = self._boxes.get(router)
        return len(box.items) if box else 0

    async def stream(self, router: str) -> AsyncIterator[Batch]:
        """One channel: batches of ``router``'s chunks as they are pushed, until replaced by a
        newer channel of the same router or idle (see the module docstring)."""
        box = self._box(router)
        box.generation += 1
        box.readers += 1
        mine = box.generation
        box.ready.set()  # hand over what waited for a channel, and stop an older channel
        try:
            yield []  # tells the router the channel is open
            while True:
                if box.generation != mine:
                    return  # a newer channel of this router reads the outbox now
                if box.items:
                    batch, box.items = box.items, []
                    yield batch
                    continue
                box.ready.clear()
                if box.active > 0:
                    await box.ready.wait()
                    continue
                try:  # nothing in flight: wait a while for new work, then end
                    await asyncio.wait_for(box.ready.wait(), self.idle_s)
                except asyncio.TimeoutError:
                    if not box.items and box.active <= 0 and box.generation == mine:
                        return
        finally:
            box.readers -= 1
            if box.readers == 0 and box.active <= 0 and self._boxes.get(router) is box:
                self._boxes.pop(router, None)  # a router that went away leaves nothing here
