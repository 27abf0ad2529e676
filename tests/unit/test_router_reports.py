"""An engine replica forgets a router whose output channel was cancelled (the router died), but
not one whose channel ended by itself or was replaced by the router's newer channel."""

from __future__ import annotations

import asyncio

from serve_app.engine.channel import OutputChannels
from serve_app.engine.router_reports import RouterReports
from serve_app.engine.server import LLMServer


class _Server(LLMServer):
    def __del__(self) -> None:  # no engine to shut down
        pass


def _server() -> LLMServer:
    server = object.__new__(_Server)  # no engine: only the channel and the reports
    server.replica_id = "replica-1"
    server.channels = OutputChannels()
    server.reports = RouterReports()
    return server


def test_a_router_whose_channel_is_cancelled_is_forgotten_regression_dead_router_kept_its_share():
    server = _server()

    async def main() -> None:
        server.reports.record("dead-router", 5, 100)
        server.reports.record("live-router", 1, 10)
        channel = server.channel("dead-router", "replica-1")
        assert await channel.__anext__() == []  # open
        reader = asyncio.ensure_future(channel.__anext__())
        await asyncio.sleep(0)
        reader.cancel()  # Serve cancels the call when the calling router's process dies
        await asyncio.gather(reader, return_exceptions=True)
        await channel.aclose()

    asyncio.run(main())
    assert dict(server.reports.demand()) == {"live-router": 11}


def test_a_channel_replaced_by_the_routers_newer_one_keeps_its_report():
    server = _server()

    async def main() -> None:
        server.reports.record("router", 2, 3)
        old = server.channel("router", "replica-1")
        assert await old.__anext__() == []
        new = server.channel("router", "replica-1")
        assert await new.__anext__() == []
        # The older channel returns (it is not cancelled): the router is alive.
        assert [batch async for batch in old] == []
        assert dict(server.reports.demand()) == {"router": 5}
        await new.aclose()  # the router goes away: forgotten
        assert server.reports.demand() == ()

    asyncio.run(main())
