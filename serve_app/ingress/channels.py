"""The router side of the output channels (:mod:`serve_app.engine.channel` has the why and the
replica side): one reader per engine replica this router has streams on, which hands each
batched chunk to the stream it belongs to.

Per streamed request: :meth:`ModelChannels.register` before the request is sent (a chunk can
arrive before the first chunk's reply), :meth:`ModelChannels.attach` once the first chunk named
the replica and went out to the client (opening a channel is a Serve call: not on the TTFT path),
:func:`chunks_after_first` to read the rest, :meth:`ModelChannels.release` when the
response ends, however it ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any, AsyncIterator

from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from serve_app.engine.protocol import GenerationChunk
from serve_app.routing.pinned import TARGET_KWARG

logger = logging.getLogger(__name__)

# After a request's own stream ended well, its last chunks are at most one batch behind on the
# channel; a channel that says nothing for this long has lost them (its replica died).
CHANNEL_TAIL_S = 10.0
REOPEN_BACKOFF_S = 0.2
OPEN_TIMEOUT_S = 10.0


class ChannelTicket:
    """One streamed request's place in its model's channels."""

    __slots__ = ("request_id", "inbox", "replica")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.inbox: asyncio.Queue[Any] = asyncio.Queue()
        self.replica: str | None = None


class ModelChannels:
    """This router replica's output channels to the replicas of one model."""

    def __init__(self, model: str, handle: DeploymentHandle, router_id: str) -> None:
        self.model = model
        self.handle = handle.options(stream=True)
        self.router_id = router_id
        self._tickets: dict[str, ChannelTicket] = {}
        self._readers: dict[str, asyncio.Task[None]] = {}
        self._in_flight: Counter[str] = Counter()

    def register(self, request_id: str) -> ChannelTicket:
        ticket = self._tickets[request_id] = ChannelTicket(request_id)
        return ticket

    def attach(self, ticket: ChannelTicket, replica: str | None) -> None:
        """The request runs on ``replica``: make sure a channel from it is open."""
        if replica is None or ticket.replica is not None:
            return
        ticket.replica = replica
        self._in_flight[replica] += 1
        if replica not in self._readers:
            self._readers[replica] = asyncio.get_running_loop().create_task(
                self._read(replica))

    def release(self, ticket: ChannelTicket) -> None:
        """The request's response ended: drop what else arrives for it (idempotent)."""
        if self._tickets.pop(ticket.request_id, None) is None:
            return
        replica = ticket.replica
        if replica is not None:
            self._in_flight[replica] -= 1
            if self._in_flight[replica] <= 0:
                del self._in_flight[replica]

    def open_channels(self) -> int:
        return len(self._readers)

    async def _read(self, replica: str) -> None:
        """Read ``replica``'s channel while this router has requests there.

        The channel is never cancelled from here once open (a batch in flight would be lost);
        the replica ends it when idle. Opening is bounded: a pinned call to a replica that is
        gone or stopping waits in Serve's routing, and a request there fails on its own."""
        try:
            while True:
                gen = None
                try:
                    gen = self.handle.channel.remote(self.router_id, **{TARGET_KWARG: replica})
                    # The replica's first message is an empty batch: the channel is open.
                    await asyncio.wait_for(gen.__anext__(), OPEN_TIMEOUT_S)
                    async for batch in gen:
                        tickets = self._tickets
                        for request_id, wire in batch:
                            ticket = tickets.get(request_id)
                            if ticket is not None:  # else its response ended already
                                ticket.inbox.put_nowait(wire)
                except asyncio.CancelledError:
                    raise
                except StopAsyncIteration:
                    pass
                except Exception as err:  # the replica went away; its streams fail on their own
                    logger.warning("output channel of %s replica %s: %r", self.model, replica,
                                   err)
                    if gen is not None:
                        gen.cancel()  # a call still waiting in Serve's routing stops waiting
                    await asyncio.sleep(REOPEN_BACKOFF_S)
                if self._in_flight.get(replica, 0) <= 0:
                    return  # ended idle (or could not open) with nothing in flight: done
                # Still requests on that replica (it ended the channel just as one started,
                # or the channel broke): open it again; chunks waited in its outbox.
        finally:
            self._readers.pop(replica, None)


# Watchers of own streams that are about to end on their own (asyncio keeps only weak
# references to tasks).
_finishing: set[asyncio.Future[None]] = set()


class _OwnStreamEnded:
    """Put in a request's inbox when its own Serve stream ends: ``error`` is what it raised."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


async def _watch_own_stream(gen: DeploymentResponseGenerator, inbox: asyncio.Queue[Any]
                            ) -> None:
    """Tell the request's reader, through its inbox, when its own stream ends and how."""
    try:
        async for _ in gen:
            pass
    except asyncio.CancelledError:
        raise
    except Exception as err:
        inbox.put_nowait(_OwnStreamEnded(err))
        return
    inbox.put_nowait(_OwnStreamEnded(None))


async def chunks_after_first(gen: DeploymentResponseGenerator, ticket: ChannelTicket,
                             tail_s: float = CHANNEL_TAIL_S) -> AsyncIterator[GenerationChunk]:
    """The request's chunks after its first, from the channel, up to the finished one.

    The request's own stream carries no chunks now but still ends the request: when it fails
    (the engine or its replica died) this raises its error; when it ends well, the last chunks
    must follow on the channel within ``tail_s``. One queue read per chunk: the own stream's end
    arrives in the same inbox, so nothing else is awaited per chunk."""
    inbox = ticket.inbox
    watcher: asyncio.Future[None] | None = asyncio.ensure_future(_watch_own_stream(gen, inbox))
    own_ended = False
    try:
        while True:
            if not own_ended:
                item = await inbox.get()
            else:
                try:
                    item = await asyncio.wait_for(inbox.get(), tail_s)
                except asyncio.TimeoutError:
                    raise ConnectionError("the output channel lost the end of the stream") \
                        from None
            if isinstance(item, _OwnStreamEnded):
                if item.error is not None:
                    raise item.error
                own_ended = True
                continue
            chunk = GenerationChunk.from_wire(item)
            if chunk.finished:
                # The own stream ends by itself right after this: let it (a cancel now would
                # reach the replica as an abort of a request that completed).
                _finishing.add(watcher)
                watcher.add_done_callback(_finishing.discard)
                watcher = None
                yield chunk
                return
            yield chunk
    finally:
        if watcher is not None and not watcher.done():
            watcher.cancel()  # the client left or the stream failed: stop watching
