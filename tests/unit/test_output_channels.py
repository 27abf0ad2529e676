"""The output channels, both sides, without Ray: the replica's outboxes
(serve_app/engine/channel.py) and the router's reading of one request's chunks
(serve_app/ingress/channels.py)."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.engine.channel import OutputChannels
from serve_app.engine.protocol import ChoiceDelta, GenerationChunk
from serve_app.ingress.channels import ChannelTicket, chunks_after_first


def _wire(text: str, finished: bool = False) -> tuple:
    return GenerationChunk([ChoiceDelta(0, text, 1)], 3, finished).to_wire()


def test_wire_form_round_trips_and_accepts_lists():
    chunk = GenerationChunk([ChoiceDelta(0, "a", 1, "stop", 7)], 5, True, {"prefill": 1.5}, "r1")
    assert GenerationChunk.from_wire(chunk.to_wire()) == chunk
    as_lists = [[list(d) for d in chunk.to_wire()[0]], 5, True, {"prefill": 1.5}, "r1"]
    assert GenerationChunk.from_wire(as_lists) == chunk


async def _take(agen, n: int) -> list:
    return [await agen.__anext__() for _ in range(n)]


def test_one_batch_per_loop_pass_for_every_request_of_a_router():
    async def run():
        ch = OutputChannels(idle_s=0.2)
        ch.begin("r1")
        ch.begin("r1")
        stream = ch.stream("r1")
        assert await stream.__anext__() == []  # open
        ch.push("r1", "a", 1)
        ch.push("r1", "b", 2)
        ch.push("r1", "a", 3)
        assert await stream.__anext__() == [("a", 1), ("b", 2), ("a", 3)]
        ch.push("r2", "c", 4)  # another router's chunk waits for that router's channel
        ch.end("r1")
        ch.end("r1")
        with pytest.raises(StopAsyncIteration):  # idle: nothing in flight for 0.2 s
            await asyncio.wait_for(stream.__anext__(), 2)
        assert ch.pending("r2") == 1
        other = ch.stream("r2")
        assert await _take(other, 2) == [[], [("c", 4)]]
        await other.aclose()
    asyncio.run(run())


def test_channel_stays_open_while_a_request_is_in_flight():
    async def run():
        ch = OutputChannels(idle_s=0.05)
        ch.begin("r1")
        stream = ch.stream("r1")
        await stream.__anext__()
        nxt = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.3)  # six idle periods: still open, a request is in flight
        assert not nxt.done()
        ch.push("r1", "a", 1)
        assert await asyncio.wait_for(nxt, 2) == [("a", 1)]
        await stream.aclose()
    asyncio.run(run())


def test_a_newer_channel_of_the_same_router_replaces_the_older():
    """Two readers of one outbox could deliver a request's chunks out of order."""
    async def run():
        ch = OutputChannels(idle_s=5)
        ch.begin("r1")
        old = ch.stream("r1")
        await old.__anext__()
        waiting = asyncio.ensure_future(old.__anext__())
        await asyncio.sleep(0)
        new = ch.stream("r1")
        assert await new.__anext__() == []
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(waiting, 2)
        ch.push("r1", "a", 1)
        assert await new.__anext__() == [("a", 1)]
        await new.aclose()
    asyncio.run(run())


def test_chunks_pushed_before_the_channel_opens_are_delivered_in_order():
    async def run():
        ch = OutputChannels(idle_s=5)
        ch.begin("r1")
        for i in range(3):
            ch.push("r1", "a", i)
        stream = ch.stream("r1")
        assert await _take(stream, 2) == [[], [("a", 0), ("a", 1), ("a", 2)]]
        await stream.aclose()
    asyncio.run(run())


class _OwnStream:
    """Stands in for a request's own Serve stream after its first chunk: yields nothing,
    then ends or raises when told."""

    def __init__(self) -> None:
        self.outcome: asyncio.Future = asyncio.get_running_loop().create_future()

    def __aiter__(self):
        return self

    async def __anext__(self):
        error = await self.outcome
        if error is None:
            raise StopAsyncIteration
        raise error


def test_chunks_come_from_the_inbox_until_the_finished_one():
    async def run():
        own, ticket = _OwnStream(), ChannelTicket("a")
        for text in ("x", "y"):
            ticket.inbox.put_nowait(_wire(text))
        reader = chunks_after_first(own, ticket)
        got = [(await reader.__anext__()).deltas[0].text for _ in range(2)]
        own.outcome.set_result(None)  # the own stream ends before the channel's last chunk
        await asyncio.sleep(0.01)
        ticket.inbox.put_nowait(_wire("z", finished=True))
        last = await reader.__anext__()
        assert got == ["x", "y"] and last.finished and last.deltas[0].text == "z"
        with pytest.raises(StopAsyncIteration):
            await reader.__anext__()
    asyncio.run(run())


def test_a_failed_own_stream_ends_the_chunks_with_its_error():
    async def run():
        own, ticket = _OwnStream(), ChannelTicket("a")
        reader = chunks_after_first(own, ticket)
        nxt = asyncio.ensure_future(reader.__anext__())
        await asyncio.sleep(0.01)
        own.outcome.set_result(RuntimeError("replica died"))
        with pytest.raises(RuntimeError, match="replica died"):
            await asyncio.wait_for(nxt, 2)
    asyncio.run(run())


def test_a_channel_that_never_brings_the_end_is_an_error_not_a_hang():
    async def run():
        own, ticket = _OwnStream(), ChannelTicket("a")
        own.outcome.set_result(None)
        reader = chunks_after_first(own, ticket, tail_s=0.1)
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(reader.__anext__(), 2)
    asyncio.run(run())


def test_chunks_of_a_finished_request_wait_for_the_channel_opened_after_it_ended():
    """A short request can finish before its router's first channel to this replica opens:
    its last chunks must still be delivered (the router would wait for them, then fail)."""
    async def run():
        ch = OutputChannels()
        ch.begin("r1")
        ch.push("r1", "a", 1)
        ch.end("r1")
        stream = ch.stream("r1")
        assert await _take(stream, 2) == [[], [("a", 1)]]
        await stream.aclose()
    asyncio.run(run())


def test_a_router_that_never_opens_a_channel_leaves_nothing_behind_after_the_ttl(monkeypatch):
    from serve_app.engine import channel

    ch = OutputChannels()
    ch.begin("gone")
    ch.push("gone", "a", 1)
    ch.end("gone")
    assert ch.pending("gone") == 1  # still claimable
    monkeypatch.setattr(channel, "UNCLAIMED_TTL_S", 0.0)
    ch.begin("other")
    assert ch.pending("gone") == 0 and list(ch._boxes) == ["other"]


def test_the_own_stream_of_a_completed_request_is_left_to_end_not_cancelled():
    """Cancelling it reaches the replica as an abort of a request that already completed."""
    async def run():
        own, ticket = _OwnStream(), ChannelTicket("a")
        cancelled = []

        class Watched(_OwnStream):
            async def __anext__(self):
                try:
                    return await super().__anext__()
                except asyncio.CancelledError:
                    cancelled.append(True)
                    raise

        own = Watched()
        reader = chunks_after_first(own, ticket)
        nxt = asyncio.ensure_future(reader.__anext__())
        await asyncio.sleep(0.01)  # the own stream is being watched
        ticket.inbox.put_nowait(_wire("end", finished=True))
        assert (await nxt).finished
        with pytest.raises(StopAsyncIteration):
            await reader.__anext__()
        await asyncio.sleep(0.01)
        own.outcome.set_result(None)  # the replica's side ends the stream
        await asyncio.sleep(0.01)
        assert not cancelled
    asyncio.run(run())
