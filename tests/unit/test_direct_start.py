"""Direct start (serve_app/engine/direct_start.py, serve_app/ingress/direct_start.py): a request's
engine starts from the socket frame, once, and its Serve call takes the stream over; what no
call claims is aborted. Real sockets on loopback, a stand-in engine, no Ray."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator

import pytest

from serve_app.engine.direct_start import ORPHAN_S, DirectStarts, frame, hello
from serve_app.engine.protocol import (
    ChoiceDelta,
    EngineRequestError,
    GenerationChunk,
    GenerationRequest,
    SamplingOptions,
)
from serve_app.ingress.direct_start import DirectStarter
from serve_app.routing.capacity import ReplicaLoad


class Engine:
    """Yields two chunks per request once ``release`` is set; records starts and aborts."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self.release = asyncio.Event()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        self.started.append(request.request_id)
        if request.prompt == "bad":
            raise EngineRequestError("bad prompt", param="prompt")
        try:
            await self.release.wait()
            yield GenerationChunk([ChoiceDelta(0, "a", 1)], 3, False)
            yield GenerationChunk([ChoiceDelta(0, "b", 1, "length")], 3, True)
            self.finished.append(request.request_id)
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted.append(request.request_id)
            raise


def request(rid: str, prompt: str = "hello", max_tokens: int = 2,
            reply_to: str | None = "router-1") -> GenerationRequest:
    return GenerationRequest(rid, SamplingOptions(max_tokens=max_tokens, stop=["x"]),
                             prompt=prompt, cache_salt="t", priority=3, reply_to=reply_to,
                             sent_direct=True)


async def until(cond, timeout: float = 5.0) -> None:
    async def wait() -> None:
        while not cond():
            await asyncio.sleep(0.005)
    await asyncio.wait_for(wait(), timeout)


async def connected(inbox: DirectStarts, key: str | None = None
                    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, _, port = inbox.address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(hello(key or inbox.key))
    return reader, writer


def test_request_wire_form_round_trips_through_msgpack() -> None:
    import msgpack

    req = GenerationRequest("r1", SamplingOptions(max_tokens=5, stop=["\n"], seed=4),
                            prompt_token_ids=[1, 2, 3], cache_salt="s", priority=7,
                            stream=False, reply_to="rt", sent_direct=True)
    back = GenerationRequest.from_wire(msgpack.unpackb(msgpack.packb(req.to_wire())))
    assert back == req
    with pytest.raises(ValueError):
        GenerationRequest.from_wire((1, (), None, None, None, True, None, 0, True, None, False))


@contextlib.asynccontextmanager
async def replica_socket(orphan_s: float = ORPHAN_S, key: str | None = None,
                         send_hello: bool = True
                         ) -> AsyncIterator[tuple[Engine, DirectStarts, asyncio.StreamReader,
                                                  asyncio.StreamWriter]]:
    """A replica's listening socket in front of :class:`Engine`, and a peer connected to it
    that sent ``key`` (the replica's own by default; nothing without ``send_hello``)."""
    engine = Engine()
    inbox = DirectStarts(engine.generate, orphan_s=orphan_s)
    await inbox.listen("127.0.0.1")
    if send_hello:
        reader, writer = await connected(inbox, key)
    else:
        host, _, port = inbox.address.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
    try:
        yield engine, inbox, reader, writer
    finally:
        writer.close()
        await inbox.close()


def start_frame(rid: str, prompt: str = "hello") -> bytes:
    return frame(("start", request(rid, prompt).to_wire()))


async def test_frame_starts_the_engine_before_the_serve_call_and_the_call_takes_it_over() -> None:
    async with replica_socket() as (engine, inbox, _, writer):
        writer.write(start_frame("r1"))
        await until(lambda: engine.started == ["r1"])  # no Serve call yet
        started = inbox.claim("r1")
        assert started is not None
        engine.release.set()
        chunks = [c async for c in started.stream()]
        assert [c.deltas[0].text for c in chunks] == ["a", "b"]
        assert engine.started == ["r1"] and engine.finished == ["r1"]
        assert (inbox.started, inbox.claimed, inbox.orphaned) == (1, 1, 0)


async def test_a_frame_after_its_serve_call_starts_nothing() -> None:
    async with replica_socket() as (engine, inbox, _, writer):
        assert inbox.claim("r1") is None  # the Serve call came first and starts the engine
        writer.write(start_frame("r1"))
        writer.write(start_frame("r2"))
        await until(lambda: engine.started == ["r2"])  # frames are read in order: r1 dropped
        assert inbox.started == 1


async def test_unclaimed_start_is_aborted_after_orphan_s() -> None:
    async with replica_socket(orphan_s=0.2) as (engine, inbox, _, writer):
        writer.write(start_frame("r1"))
        await until(lambda: engine.aborted == ["r1"])
        assert inbox.orphaned == 1 and inbox.claim("r1") is None


async def test_abort_frame_stops_an_unclaimed_start() -> None:
    async with replica_socket() as (engine, inbox, _, writer):
        writer.write(start_frame("r1"))
        await until(lambda: engine.started == ["r1"])
        writer.write(frame(("abort", "r1")))
        await until(lambda: engine.aborted == ["r1"])
        assert inbox.orphaned == 0


async def test_cancelling_the_claiming_call_aborts_the_engine() -> None:
    async with replica_socket() as (engine, inbox, _, writer):
        writer.write(start_frame("r1"))
        await until(lambda: engine.started == ["r1"])
        started = inbox.claim("r1")
        assert started is not None
        stream = started.stream()
        task = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)  # one loop pass: the call is now awaiting the first chunk
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await stream.aclose()
        assert engine.aborted == ["r1"]


async def test_engine_error_before_the_first_chunk_reaches_the_serve_call() -> None:
    async with replica_socket() as (engine, inbox, _, writer):
        writer.write(start_frame("r1", prompt="bad"))
        await until(lambda: engine.started == ["r1"])
        started = inbox.claim("r1")
        assert started is not None
        with pytest.raises(EngineRequestError, match="bad prompt"):
            await started.stream().__anext__()


async def test_peer_without_the_key_starts_nothing() -> None:
    async with replica_socket(key="0" * 32) as (engine, inbox, reader, writer):
        writer.write(start_frame("r1"))
        assert await asyncio.wait_for(reader.read(), 5) == b""  # the replica hung up
        assert engine.started == [] and inbox.started == 0


@pytest.mark.parametrize("authenticated, garbage", [
    (False, (300).to_bytes(4, "big") + b"k" * 300),  # a "key" longer than any: never read
    (True, (3).to_bytes(4, "big") + b"\xc1\xc1\xc1"),  # not msgpack
    (True, frame(("start", ["not", "a", "request"]))),  # msgpack, but no request
    (True, frame(("start", None))),
], ids=["long-hello", "not-msgpack", "not-a-request", "no-request"])
async def test_a_bad_frame_drops_its_peer_and_the_socket_keeps_serving(authenticated, garbage
                                                                        ) -> None:
    async with replica_socket(send_hello=authenticated) as (engine, inbox, reader, writer):
        writer.write(garbage)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # that peer is dropped
        _, other = await connected(inbox)  # another peer is served as before
        other.write(start_frame("r1"))
        await until(lambda: engine.started == ["r1"])
        assert inbox.started == 1
        other.close()


@contextlib.asynccontextmanager
async def two_replicas(active_a: int, active_b: int
                       ) -> AsyncIterator[tuple[list[Engine], list[ReplicaLoad]]]:
    """Replicas "a" and "b" listening, and the load poll's view of them."""
    engines = [Engine(), Engine()]
    inboxes = [DirectStarts(e.generate) for e in engines]
    for inbox in inboxes:
        await inbox.listen("127.0.0.1")
    view = [ReplicaLoad(name, active=n, running=n, waiting=0, direct=inbox.address,
                        direct_key=inbox.key)
            for name, n, inbox in (("a", active_a, inboxes[0]), ("b", active_b, inboxes[1]))]
    try:
        yield engines, view
    finally:
        for inbox in inboxes:
            await inbox.close()


async def test_starter_sends_to_the_least_loaded_replica_once_connected() -> None:
    async with two_replicas(5, 3) as (engines, view):
        starter = DirectStarter()
        first = request("r0")
        first.sent_direct = False
        target = starter.choose(view)
        assert target is not None and target.replica == "b"
        assert not starter.send(target, first) and not first.sent_direct  # opening the socket
        await until(lambda: starter._peers["b"].writer is not None)
        picks = []
        for n in range(4):  # b has 3, a has 5: b, b (4, 5), then one each
            req = request(f"r{n + 1}")
            target = starter.choose(view)
            assert target is not None
            if target.replica == "a":
                assert not starter.send(target, req)  # a's socket opens now
                await until(lambda: starter._peers["a"].writer is not None)
                assert starter.send(target, req)
            else:
                assert starter.send(target, req)
            picks.append(target.replica)
        assert picks[:2] == ["b", "b"] and sorted(picks[2:]) == ["a", "b"]  # then a tie
        await until(lambda: len(engines[1].started) == 3 and len(engines[0].started) == 1)
        on_a = f"r{picks.index('a') + 1}"
        starter.abort("a", on_a)
        await until(lambda: engines[0].aborted == [on_a])
        starter.close()


def test_equally_loaded_replicas_take_turns_regression_first_replica_took_every_request() -> None:
    """At low load every poll shows the replicas idle: the choice must not always fall on the
    first one listed (it did: a second replica took nothing at c=1)."""
    starter = DirectStarter()
    picks = []
    for _ in range(10):  # a fresh poll before each request, both idle
        view = [ReplicaLoad(replica=name, active=0, running=0, waiting=0, direct="x:1")
                for name in ("a", "b")]
        picks.append(starter.choose(view).replica)
    assert picks.count("a") == picks.count("b") == 5, picks
    loaded = [ReplicaLoad(replica="a", active=2, running=2, waiting=0, direct="x:1"),
              ReplicaLoad(replica="b", active=1, running=1, waiting=0, direct="x:1")]
    assert {starter.choose(loaded).replica for _ in range(4)} == {"b"}  # load still decides


@contextlib.asynccontextmanager
async def llm_server_and_starter() -> AsyncIterator[tuple[Any, DirectStarter, ReplicaLoad]]:
    """An LLMServer on the scripted engine (no Ray) and a router's starter connected to it."""
    from serve_app.engine.scripted import SCRIPTED_ENGINE_CLASS
    from serve_app.engine.server import LLMServer

    server = LLMServer.__new__(LLMServer)
    await server.__init__({"name": "m", "path": "unused", "device": "cpu",
                           "engine_kwargs": {"scripted_step_s": 0.005}}, SCRIPTED_ENGINE_CLASS)
    load = ReplicaLoad.from_report(await server.engine_load())
    assert load.direct is not None and load.direct_key
    starter = DirectStarter()
    assert starter.choose([load]) is load
    assert not starter.send(load, request("warm-up"))  # opens the socket
    await until(lambda: starter._peers[load.replica].writer is not None)
    try:
        yield server, starter, load
    finally:
        starter.close()
        await server.__del__()


async def test_llm_server_serve_call_takes_over_the_direct_start() -> None:
    async with llm_server_and_starter() as (server, starter, load):
        req = request("r1", max_tokens=3, reply_to=None)
        assert starter.send(load, req) and req.sent_direct
        await until(lambda: server.direct.started == 1)
        wires = [w async for w in server.generate(req, prefer_replica=load.replica)]
        chunks = [GenerationChunk.from_wire(w) for w in wires]
        assert chunks[0].replica == server.replica_id and chunks[-1].finished
        assert sum(d.num_tokens for c in chunks for d in c.deltas) == 3
        assert server.engine.started_order() == ["r1"]  # started once, by the frame
        report = await server.engine_load()
        assert (report["direct_started"], report["direct_claimed"], report["direct_orphaned"]) \
            == (1, 1, 0)
        # What `serve-app status` shows per replica: requests taken (one call), and its node
        # (the integration test checks it is a live Ray node; "" here unless the suite's Ray
        # is up in this process).
        after = ReplicaLoad.from_report(report)
        assert (after.requests_total, after.active, after.node) == (1, 0, server.node_id)


async def test_llm_server_serve_call_first_starts_the_engine_and_the_late_frame_is_dropped(
) -> None:
    async with llm_server_and_starter() as (server, starter, load):
        req = request("r1", reply_to=None)
        req.sent_direct = True  # as if the frame were still on its way
        wires = [w async for w in server.generate(req, prefer_replica=load.replica)]
        assert GenerationChunk.from_wire(wires[-1]).finished
        assert starter.send(load, req)  # the frame arrives after its Serve call
        later = request("r2", reply_to=None)
        assert starter.send(load, later)
        await until(lambda: server.direct.started == 1)  # r2 only: frames are read in order
        assert server.engine.started_order() == ["r1", "r2"]


async def test_llm_server_cancelled_serve_call_aborts_the_direct_start() -> None:
    async with llm_server_and_starter() as (server, starter, load):
        req = request("r1", max_tokens=2_000, reply_to=None)
        assert starter.send(load, req)
        await until(lambda: server.direct.started == 1)
        gen = server.generate(req, prefer_replica=load.replica)
        await gen.__anext__()  # the first chunk: the engine is generating
        assert server.engine.load().running == 1
        await gen.aclose()  # Serve closes the call when the router cancels it
        await until(lambda: server.engine.load().running == 0)
        assert server.active == 0


async def test_a_replica_serve_did_not_route_to_gets_no_direct_starts_for_a_while(monkeypatch):
    """A stopping replica may still be in the last load poll; Serve no longer routes to it."""
    import serve_app.ingress.direct_start as router_side

    async with two_replicas(0, 9) as (engines, view):
        starter = DirectStarter()
        target = starter.choose(view)
        assert target is not None and target.replica == "a"
        starter.send(target, request("r0"))
        await until(lambda: starter._peers["a"].writer is not None)
        assert starter.send(target, request("r1"))
        await until(lambda: engines[0].started == ["r1"])
        monkeypatch.setattr(router_side, "AVOID_S", 0.3)
        starter.went_elsewhere("a", "r1")  # the first chunk came from another replica
        await until(lambda: engines[0].aborted == ["r1"])
        chosen = starter.choose(view)
        assert chosen is not None and chosen.replica == "b"  # a is skipped although least loaded
        await until(lambda: starter.choose(view).replica == "a")  # after AVOID_S
        starter.close()


async def test_an_unreachable_replica_is_retried_with_backoff_and_requests_go_by_serve():
    """A firewalled or dead port must not cost a connect attempt (and a log line) a second."""
    import socket
    import time

    from serve_app.ingress.direct_start import RETRY_S

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    view = [ReplicaLoad("a", active=0, running=0, waiting=0, direct=f"127.0.0.1:{port}",
                        direct_key="k")]
    starter = DirectStarter()
    target = starter.choose(view)
    assert target is not None
    waits = []
    for _ in range(4):
        before = time.monotonic()
        assert not starter.send(target, request("r"))  # no socket: the Serve call goes alone
        waits.append(starter._retry_at["a"] - before)
        await until(lambda: starter._peers["a"].done)  # refused
        assert not starter.send(target, request("r"))  # within the backoff: no new attempt
        assert "a" not in starter._peers
        starter._retry_at["a"] = 0.0  # let the next attempt go now
    assert [round(w / RETRY_S) for w in waits] == [1, 2, 4, 8], waits
    starter.close()
