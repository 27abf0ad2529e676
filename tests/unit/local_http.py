"""A small aiohttp server on a free local port, for tests of the bench's HTTP clients."""

from __future__ import annotations

from aiohttp import web


async def serve_completions(handler) -> tuple[web.AppRunner, str]:
    """Serve ``handler`` at POST /v1/completions on 127.0.0.1; returns the runner (clean it up)
    and the base URL."""
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"
