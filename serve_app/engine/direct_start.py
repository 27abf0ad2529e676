"""Direct start, the engine replica's side: a request reaches its engine over a plain TCP socket
while its Serve call is still on the way, so the engine starts on the request that much sooner.

Why: Serve's call from a router replica to an engine replica crosses several threads on each
side (Serve's request router, gRPC's poller, the replica's event loop), and after a quiet spell
each must be woken: a request's hop took 2.0-2.3 ms on the H200 host, against 1.3 ms for calls
back to back (bench/RESULTS.md 12e), on its time to first token. One socket write wakes one
thread: on the 2-core CPU machine after 20 ms of quiet, 0.33 ms for a write to an asyncio
socket against 2.5-2.7 ms for Serve's call (1.1 ms for gRPC alone).

Contract (:mod:`serve_app.ingress.direct_start` is the router's side):

* The router sends the request (``start``) to the replica it chose and also makes the Serve
  call, routed to the same replica by preference (:mod:`serve_app.routing.pinned`), with
  ``GenerationRequest.sent_direct`` set. The Serve call stays the request: its stream carries
  the first chunk (errors before it become HTTP status codes), Serve counts it (drain,
  ``max_ongoing_requests``, autoscaling), and cancelling it aborts the engine's work. The
  socket only lets the engine start while the Serve call is on its way (a prefill takes far
  longer than the call).
* Whichever comes first starts the engine, once: the Serve call claims a started request by
  id (:meth:`DirectStarts.claim`); a ``start`` for an id the Serve call already claimed is
  dropped.
* A started request whose Serve call does not come within ``orphan_s`` (its router went away,
  Serve sent the call to another replica, the client left before Serve sent it) is aborted;
  routers also send ``abort`` for a request they give up before its first chunk.
* Nothing depends on the socket: a router that cannot connect, or a lost frame, leaves the
  Serve call to start the request itself.
* Wire: a connection opens with a frame holding this replica's random key (routers learn it
  from ``engine_load``, a Serve call); a peer without it is disconnected before it can send
  anything larger. Then frames of a 4-byte big-endian length and a msgpack list: ``["start",
  GenerationRequest.to_wire()]`` or ``["abort", request_id]``. No pickle crosses this socket.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from typing import Any, AsyncIterator, Callable

import msgpack

from serve_app.engine.protocol import GenerationChunk, GenerationRequest

logger = logging.getLogger(__name__)

# A started request whose Serve call has not come after this long is aborted. Serve's call
# follows its socket frame by about a millisecond; the margin covers a router's event loop
# stalled by a burst and Serve's routing retries.
ORPHAN_S = 10.0
HELLO_MAX = 256  # bytes of the first frame (the key), before the peer is known
FRAME_MAX = 256 * 1024 * 1024  # a request of the router's largest body, with room to spare

EngineStart = Callable[[GenerationRequest], AsyncIterator[GenerationChunk]]


def frame(payload: Any) -> bytes:
    """One frame: 4-byte big-endian length, then ``payload`` as msgpack."""
    body = msgpack.packb(payload, use_bin_type=True)
    return len(body).to_bytes(4, "big") + body


def hello(key: str) -> bytes:
    """The frame a connection opens with."""
    raw = key.encode()
    return len(raw).to_bytes(4, "big") + raw


async def _read_frame(reader: asyncio.StreamReader, limit: int) -> bytes:
    size = int.from_bytes(await reader.readexactly(4), "big")
    if size > limit:
        raise ValueError(f"frame of {size} bytes (at most {limit})")
    return await reader.readexactly(size)


class _Started:
    """One request the socket started: its engine stream and the task awaiting the first
    chunk (the engine works on it from the moment the frame is read). The replica's Serve call
    awaits ``first`` and iterates ``chunks`` itself (no generator layer per chunk on the
    replica's busiest loop); :meth:`stream` is the same as one iterator."""

    __slots__ = ("chunks", "first", "at")

    def __init__(self, chunks: AsyncIterator[GenerationChunk]) -> None:
        self.chunks = chunks
        self.first: asyncio.Future[GenerationChunk] = asyncio.ensure_future(
            chunks.__anext__())  # type: ignore[arg-type]
        self.at = time.monotonic()

    async def stream(self) -> AsyncIterator[GenerationChunk]:
        """The engine's chunks, the first included; closing this aborts the engine's work."""
        try:
            try:
                first = await self.first  # cancelling the caller here cancels the engine call
            except StopAsyncIteration:
                return
            yield first
            async for chunk in self.chunks:
                yield chunk
        finally:
            await self.close()

    async def close(self) -> None:
        """Abort the engine's work if it is not done (idempotent)."""
        if not self.first.done():
            self.first.cancel()
            await asyncio.gather(self.first, return_exceptions=True)
        elif not self.first.cancelled():
            self.first.exception()  # retrieved: an orphan's error must not be logged as lost
        aclose = getattr(self.chunks, "aclose", None)
        if aclose is not None:
            await aclose()


class DirectStarts:
    """The replica's direct-start socket and the requests it started (see the module doc)."""

    def __init__(self, start: EngineStart, orphan_s: float = ORPHAN_S) -> None:
        self._start = start
        self.orphan_s = orphan_s
        self.key = secrets.token_hex(16)
        self.address: str | None = None  # "host:port" once listening
        self._pending: dict[str, _Started] = {}
        self._claimed: dict[str, float] = {}  # Serve call came first: drop a later frame
        self._closing: set[asyncio.Task[None]] = set()
        self._peers: dict[asyncio.StreamWriter, asyncio.Task] = {}  # open peer -> its reader
        self._server: asyncio.AbstractServer | None = None
        self._reaper: asyncio.Task[None] | None = None
        self.started = 0  # requests started from the socket (diagnostics, tests)
        self.claimed = 0  # of them, claimed by their Serve call
        self.orphaned = 0  # of them, aborted because no Serve call came

    async def listen(self, host: str) -> str:
        """Accept routers on ``host`` (a free port); returns the address they connect to."""
        self._server = await asyncio.start_server(self._serve_peer, host, 0)
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"{host}:{port}"
        self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())
        return self.address

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        if self._server is not None:
            self._server.close()
        for writer in list(self._peers):
            writer.close()
        # Each peer's reader then ends at EOF; wait for them, so none is left for the event
        # loop to cancel at shutdown (asyncio logs a cancelled connection handler as an error).
        if self._peers:
            await asyncio.wait(list(self._peers.values()), timeout=1.0)
        for rid in list(self._pending):
            self.abort(rid)

    def claim(self, request_id: str) -> _Started | None:
        """What the socket started for ``request_id`` (its Serve call has come): the caller
        awaits ``first``, then iterates ``chunks``, and ``close()``-s it however it ends (or
        iterates ``stream()``, which does all three). None: the Serve call starts the engine
        itself, and a frame that comes later is dropped."""
        started = self._pending.pop(request_id, None)
        if started is None:
            self._claimed[request_id] = time.monotonic()
            return None
        self.claimed += 1
        return started

    def start(self, request: GenerationRequest) -> None:
        """Start the engine on ``request`` unless its Serve call already did."""
        rid = request.request_id
        if self._claimed.pop(rid, None) is not None or rid in self._pending:
            return
        self._pending[rid] = _Started(self._start(request))
        self.started += 1

    def abort(self, request_id: str) -> None:
        """Stop a started request nobody claimed (no-op otherwise: a claimed one is its Serve
        call's, which aborts it when cancelled)."""
        started = self._pending.pop(request_id, None)
        if started is not None:
            task = asyncio.get_running_loop().create_task(started.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def reap(self, now: float | None = None) -> None:
        """Abort started requests older than ``orphan_s`` that no Serve call claimed."""
        now = time.monotonic() if now is None else now
        for rid, started in list(self._pending.items()):
            if now - started.at > self.orphan_s:
                self.orphaned += 1
                logger.warning("direct start: request %s had no Serve call after %.0f s; "
                               "aborted", rid, self.orphan_s)
                self.abort(rid)
        for rid, at in list(self._claimed.items()):
            if now - at > self.orphan_s:
                del self._claimed[rid]

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.orphan_s / 2))
            self.reap()

    async def _serve_peer(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        self._peers[writer] = asyncio.current_task()
        try:
            key = await asyncio.wait_for(_read_frame(reader, HELLO_MAX), 5.0)
            if not hmac.compare_digest(key, self.key.encode()):
                logger.warning("direct start: refused a peer without this replica's key: %s",
                               peer)
                return
            while True:
                op, arg = msgpack.unpackb(await _read_frame(reader, FRAME_MAX), raw=False)
                if op == "start":
                    self.start(GenerationRequest.from_wire(arg))
                elif op == "abort":
                    self.abort(str(arg))
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError):
            pass  # the router went away (or never spoke): its Serve calls decide the rest
        except Exception as err:  # a malformed frame: drop the peer, keep serving
            logger.warning("direct start: dropped %s after a bad frame: %r", peer, err)
        finally:
            self._peers.pop(writer, None)
            writer.close()
