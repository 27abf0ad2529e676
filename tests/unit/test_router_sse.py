"""The router's SSE body: the order of its work around the first event (no Ray needed)."""

from __future__ import annotations

import asyncio

from serve_app.engine.protocol import ChoiceDelta, GenerationChunk
from serve_app.ingress.channels import ChannelTicket
from serve_app.ingress.responses import ResponseBuilder
from serve_app.ingress.pipeline import RequestPipeline


class _RecordingChannels:
    """Stands in for ModelChannels: notes when the stream attaches, then feeds the rest."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def attach(self, ticket: ChannelTicket, replica: str | None) -> None:
        self.log.append(f"attach {replica}")
        last = GenerationChunk([ChoiceDelta(0, " b", 1, "length")], 3, True)
        ticket.inbox.put_nowait(last.to_wire())


class _OwnStream:
    """The request's own Serve stream: stays open until the last chunk came, then ends."""

    def __init__(self) -> None:
        self.done = asyncio.Event()

    def __aiter__(self):
        return self

    async def __anext__(self):
        await self.done.wait()
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.done.set()


def test_channel_opens_after_the_first_event_regression_channel_open_sat_on_ttft():
    """Opening an output channel (after the replica closed an idle one) is a Serve call; made
    before the first event was written, it delayed the TTFT of every request that followed a
    quiet spell of 5 s. The first event goes out first."""
    log: list[str] = []

    async def main():
        builder = ResponseBuilder("completion", "cmpl-1", "m", 1)
        first = GenerationChunk([ChoiceDelta(0, "a", 1)], 3, False, None, "replica-1")
        ticket = ChannelTicket("cmpl-1")
        own = _OwnStream()
        body = RequestPipeline._sse(own, first, ticket, _RecordingChannels(log), builder, False,
                           lambda status: log.append(f"end {status}"))
        async for event in body:
            log.append("event" if b"data: {" in event else event.decode().strip())
            if len(log) == 2:
                own.done.set()

    asyncio.run(main())
    assert log[:2] == ["event", "attach replica-1"]
    assert log[-2:] == ["data: [DONE]", "end 200"]
