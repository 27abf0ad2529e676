"""Fair queuing on the real stack: with the model at its in-flight cap (4 in the suite), one
tenant's backlog does not delay another tenant's request behind all of it, and a high-priority
tenant's request goes before every waiting normal one."""

from __future__ import annotations

import asyncio
import time

import httpx

from .conftest import IN_FLIGHT

FLOOD = 16  # team-a's backlog: four times the cap


async def _timed(client: httpx.AsyncClient, stack, tenant: str, done: list, max_tokens: int):
    r = await client.post("/v1/completions", headers={
        "Authorization": f"Bearer {stack['keys'][tenant]}"}, json={
        "model": stack["model"], "prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True})
    assert r.status_code == 200, r.text
    done.append((tenant, time.monotonic()))


def _finished_before(done: list, tenant: str, other: str) -> int:
    t_end = next(t for name, t in done if name == tenant)
    return sum(1 for name, t in done if name == other and t < t_end)


def _run_with_late_tenant(stack, late_tenant: str) -> list:
    async def main() -> list:
        done: list = []
        async with httpx.AsyncClient(base_url=stack["base"], timeout=300) as client:
            flood = [asyncio.create_task(_timed(client, stack, "team-a", done, 256))
                     for _ in range(FLOOD)]
            await asyncio.sleep(1.0)  # team-a's backlog is queued in the router
            await _timed(client, stack, late_tenant, done, 256)
            await asyncio.gather(*flood)
        return done
    return asyncio.run(main())


def test_a_backlogged_tenant_does_not_starve_another(stack):
    done = _run_with_late_tenant(stack, "team-c")
    ahead = _finished_before(done, "team-c", "team-a")
    # FCFS would finish all of team-a's queued requests first (>= FLOOD - IN_FLIGHT); the fair
    # queue gives team-c the next free slot, so it finishes about with the batch it joins.
    assert ahead <= 2 * IN_FLIGHT, f"{ahead} of team-a's requests finished first"


def test_high_priority_goes_before_waiting_normal_requests(stack):
    done = _run_with_late_tenant(stack, "team-b")  # team-b is the high-priority tenant
    ahead = _finished_before(done, "team-b", "team-a")
    assert ahead <= 2 * IN_FLIGHT, f"{ahead} of team-a's requests finished first"


def test_router_queue_drains(stack):
    # Nothing is left waiting or holding a slot once the floods are over: a full cap of
    # concurrent requests is admitted at once.
    async def main() -> float:
        async with httpx.AsyncClient(base_url=stack["base"], timeout=120,
                                     headers=stack["headers"]) as client:
            t0 = time.monotonic()
            rs = await asyncio.gather(*[client.post("/v1/completions", json={
                "model": stack["model"], "prompt": "x", "max_tokens": 2})
                for _ in range(IN_FLIGHT)])
            assert all(r.status_code == 200 for r in rs)
            return time.monotonic() - t0
    assert asyncio.run(main()) < 30
