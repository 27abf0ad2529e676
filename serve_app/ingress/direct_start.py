"""Direct start, the router's side (:mod:`serve_app.engine.direct_start` has the why and the
contract): which engine replica a request goes to, and its ``start`` frame over one socket per
replica, written before the Serve call that carries the request.

Per request: :meth:`DirectStarter.choose` a replica from the engine feed's latest view,
:meth:`DirectStarter.send` the request there (False: no socket yet, the Serve call goes alone and
Serve routes it), make the Serve call with ``prefer_replica`` naming the replica, and
:meth:`DirectStarter.abort` if the request is given up before its first chunk.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Sequence

from serve_app.engine.direct_start import frame, hello
from serve_app.engine.protocol import GenerationRequest
from serve_app.routing.capacity import ReplicaLoad

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 2.0
# A replica whose socket failed is tried again after RETRY_S, doubling per failure in a row up
# to RETRY_MAX_S (a firewalled port must not cost a connect attempt and a log line a second).
RETRY_S = 1.0
RETRY_MAX_S = 60.0
# A replica Serve did not send a preferring call to (it is stopping, most likely, and the last
# load poll still listed it) gets no direct starts for this long.
AVOID_S = 5.0
# A socket this far behind is no faster than Serve's call: requests go by the call alone.
WRITE_BUFFER_MAX = 4 * 1024 * 1024


class _Peer:
    """One socket to one engine replica; it reads nothing but the replica's close."""

    def __init__(self, address: str, key: str, quiet: bool = False) -> None:
        self.address = address
        self.key = key
        self.quiet = quiet  # an earlier attempt was logged already
        self.connected = False  # it got as far as a connection (resets the retry backoff)
        self.writer: asyncio.StreamWriter | None = None
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        host, _, port = self.address.rpartition(":")
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)),
                                                    CONNECT_TIMEOUT_S)
        except (OSError, ValueError, asyncio.TimeoutError) as err:
            (logger.debug if self.quiet else logger.warning)(
                "direct start: cannot reach %s: %r (requests go by Serve alone; retrying with "
                "backoff)", self.address, err)
            return
        writer.write(hello(self.key))
        self.connected = True
        self.writer = writer
        try:
            await reader.read()  # returns when the replica closes the socket
        except OSError:
            pass
        finally:
            self.writer = None
            writer.close()

    def send(self, data: bytes) -> bool:
        writer = self.writer
        if (writer is None or writer.is_closing()
                or writer.transport.get_write_buffer_size() > WRITE_BUFFER_MAX):
            return False
        writer.write(data)
        return True

    @property
    def done(self) -> bool:
        return self.task.done()

    def close(self) -> None:
        self.task.cancel()
        if self.writer is not None:
            self.writer.close()


class DirectStarter:
    """This router replica's direct starts for the replicas of one model."""

    def __init__(self) -> None:
        self._peers: dict[str, _Peer] = {}
        self._retry_at: dict[str, float] = {}
        self._failures: Counter[str] = Counter()  # failed sockets in a row, per replica
        self._sent_since_view: Counter[str] = Counter()
        self._view: Sequence[ReplicaLoad] | None = None
        self._avoid_until: dict[str, float] = {}
        self.sent = 0  # requests started directly (diagnostics, tests)
        self._turn = 0  # where the next choice starts looking: ties go round the replicas

    def choose(self, replicas: Sequence[ReplicaLoad]) -> ReplicaLoad | None:
        """The replica for the next request: of those with a direct-start socket, the one with
        the fewest requests, as its latest report counted them plus those this router sent it
        since (so a burst between two polls spreads); of equally loaded ones, each in turn (at
        low load every poll shows them all idle, and the first would take every request).
        None: no replica has a socket."""
        if replicas is not self._view:  # a new poll: its reports count what went before
            self._view = replicas
            self._sent_since_view.clear()
            live = {r.replica for r in replicas}
            for rid in [rid for rid in self._peers if rid not in live]:
                self._peers.pop(rid).close()
                self._failures.pop(rid, None)
                self._retry_at.pop(rid, None)
        best: ReplicaLoad | None = None
        best_load = 0
        avoid = self._avoid_until
        now = time.monotonic() if avoid else 0.0
        n = len(replicas)
        first = self._turn % n if n else 0
        self._turn += 1
        for i in range(n):
            r = replicas[(first + i) % n]
            if r.direct is None or (avoid and avoid.get(r.replica, 0.0) > now):
                continue
            load = r.active + self._sent_since_view[r.replica]
            if best is None or load < best_load:
                best, best_load = r, load
        return best

    def send(self, replica: ReplicaLoad, request: GenerationRequest) -> bool:
        """Start ``request`` on ``replica`` over its socket (marks ``request.sent_direct``).
        False when it cannot go now (the socket is still being opened, or failed): the Serve
        call then goes alone."""
        peer = self._peer(replica)
        if peer is None:
            return False
        request.sent_direct = True
        if not peer.send(frame(("start", request.to_wire()))):
            request.sent_direct = False
            return False
        self._sent_since_view[replica.replica] += 1
        self.sent += 1
        return True

    def abort(self, replica: str, request_id: str) -> None:
        """The router gave ``request_id`` up before its first chunk: the replica stops it if
        its Serve call never claimed it."""
        peer = self._peers.get(replica)
        if peer is not None:
            peer.send(frame(("abort", request_id)))

    def went_elsewhere(self, replica: str, request_id: str) -> None:
        """Serve sent the call of ``request_id``, started on ``replica``, to another replica:
        abort it there, and start nothing there for :data:`AVOID_S`."""
        self.abort(replica, request_id)
        now = time.monotonic()
        self._avoid_until = {r: t for r, t in self._avoid_until.items() if t > now}
        self._avoid_until[replica] = now + AVOID_S

    def close(self) -> None:
        for peer in self._peers.values():
            peer.close()
        self._peers.clear()

    def _peer(self, replica: ReplicaLoad) -> _Peer | None:
        """The open socket to ``replica``, or None (one is opened for later requests)."""
        rid = replica.replica
        peer = self._peers.get(rid)
        if peer is not None and (peer.done or peer.address != replica.direct):
            self._peers.pop(rid).close()
            if peer.connected:
                self._failures.pop(rid, None)
            else:
                self._failures[rid] += 1
            peer = None
        if peer is None:
            now = time.monotonic()
            if replica.direct is None or now < self._retry_at.get(rid, 0.0):
                return None
            failures = self._failures.get(rid, 0)
            self._retry_at[rid] = now + min(RETRY_MAX_S, RETRY_S * 2 ** failures)
            self._peers[rid] = _Peer(replica.direct, replica.direct_key, quiet=failures > 0)
            return None
        return peer
