"""Disconnect storm: clients abandon a burst of requests while the engines are saturated.

``n`` requests (every other one streamed, the two tenants alternating) are cancelled by their
clients from ``after_s`` to ``after_s + 2`` s after they were sent, so the storm catches
requests in every state: queued, in prefill, streaming, generating a non-streamed answer.
Bound: within 5 s of the last client leaving the stack is idle (:func:`stack_idle`), and the
sampled peak shows that engines were running and the router was queueing during the storm.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp

from serve_bench.chaos.report import Scenario
from serve_bench.chaos.stack import TENANTS
from serve_bench.chaos.target import Target, client_session, request, stack_idle, wait_until


async def disconnect_storm(t: Target, n: int = 200, after_s: float = 0.5) -> Scenario:
    kv_idle = max(e["kv_cache_usage"] for e in await asyncio.to_thread(t.engines))
    peak = {"running": 0, "queued": 0}

    async def abandon(session: aiohttp.ClientSession, i: int) -> None:
        task = asyncio.create_task(request(session, t, list(TENANTS)[i % 2], stream=i % 2 == 0,
                                           max_tokens=1000))
        # A fifth leave at after_s, the others up to 2 s later: on a small machine nothing of a
        # 200-request burst is running yet at 0.5 s, and the storm must catch requests in every
        # state (queued, in prefill, streaming, generating a non-streamed answer).
        await asyncio.sleep(after_s + 0.5 * (i % 5))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def sample(until: asyncio.Event) -> None:
        while not until.is_set():
            engines, adm = await asyncio.to_thread(t.engines), await asyncio.to_thread(t.admission)
            peak["running"] = max(peak["running"], sum(e["running"] for e in engines))
            peak["queued"] = max(peak["queued"], adm["queued"])
            await asyncio.sleep(0.05)

    done = asyncio.Event()
    async with client_session() as session:
        sampler = asyncio.create_task(sample(done))
        await asyncio.gather(*[abandon(session, i) for i in range(n)])
        done.set()
        await sampler
    left = time.monotonic()
    idle_after = await asyncio.to_thread(wait_until, lambda: stack_idle(t, kv_idle), 30)
    figures = {"requests": n, "abandoned_after_s": f"{after_s:g}-{after_s + 2:g}",
               "engines_running_at_peak":
               peak["running"], "router_queued_at_peak": peak["queued"],
               "idle_after_s": None if idle_after is None else round(idle_after, 2),
               "measured_from": "the last client left", "kv_cache_idle": round(kv_idle, 4),
               "waited_s": round(time.monotonic() - left, 2)}
    passed = (idle_after is not None and idle_after <= 5.0 and peak["running"] > 0
              and peak["queued"] > 0)
    return Scenario("disconnect storm", passed, figures,
                    {"idle_after_s": "<= 5", "engines_running_at_peak": "> 0",
                     "router_queued_at_peak": "> 0 (requests left while queued too)"})
