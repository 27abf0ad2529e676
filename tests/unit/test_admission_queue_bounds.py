"""Queue bounds per band and per tenant in admission (issue 37: one tenant locked its band out).

A tenant held back by its ``max_concurrent_requests`` waits however idle the engines are; its
waiting requests filled the band's queue and every other tenant of the band got 429."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.admission.controller import AdmissionController, QueueFull
from serve_app.config import ConfigError, RouterSettings, TenantSettings, parse_config
from serve_app.governance.concurrency import ConcurrencyCaps
from serve_app.governance.keys import key_digest, new_key

POLICIES = ("fair", "fifo")


def _tenant(name: str, cap: int | None = None) -> TenantSettings:
    return TenantSettings(name=name, api_key_sha256=[key_digest(new_key())],
                          max_concurrent_requests=cap)


async def _queue(ac: AdmissionController, tenant: str, count: int,
                 band: str = "normal") -> list[asyncio.Task]:
    """``count`` requests of ``tenant`` that wait (or start); returns their tasks."""
    tasks = []
    for _ in range(count):
        tasks.append(asyncio.create_task(ac.acquire(tenant, band)))
        await asyncio.sleep(0)
    return tasks


async def _cancel(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.parametrize("policy", POLICIES)
def test_capped_tenant_with_100_waiting_leaves_its_band_open_regression_band_lockout(policy):
    """Tenant `capped` (max_concurrent_requests 2) sends 102 requests: 2 start, 100 wait and
    fill the band's bound, the engines nearly idle. Another tenant of the same band still gets
    every request in: the first 8 start at once, the next 40 wait, none gets QueueFull."""
    async def main():
        caps = ConcurrencyCaps([_tenant("capped", 2), _tenant("team-a")])
        ac = AdmissionController(capacity=10, max_queued=100, policy=policy, caps=caps)
        capped = await _queue(ac, "capped", 102)
        assert caps.held == {"capped": 2} and ac.queued("normal") == 100
        team_a = await _queue(ac, "team-a", 48)
        refused = [t.exception() for t in team_a if t.done() and t.exception() is not None]
        assert not refused, f"team-a got {len(refused)} QueueFull"
        assert sum(t.done() for t in team_a) == 8 and ac.queued("normal") == 140
        assert ac.tenant_in_flight == {"capped": 2, "team-a": 8}
        await _cancel(capped + team_a)
    asyncio.run(main())


@pytest.mark.parametrize("policy", POLICIES)
def test_a_tenant_over_its_own_bound_gets_queue_full_and_others_do_not(policy):
    async def main():
        ac = AdmissionController(capacity=1, max_queued=100, policy=policy,
                                 max_queued_per_tenant=3)
        await ac.acquire("flood", "normal")  # fills the capacity
        flood = await _queue(ac, "flood", 3)
        with pytest.raises(QueueFull) as refused:
            await ac.acquire("flood", "normal")
        assert refused.value.reason == "tenant" and refused.value.band == "normal"
        assert "3 of your requests waiting" in str(refused.value)
        with pytest.raises(QueueFull):  # its bound counts its requests in every band
            await ac.acquire("flood", "high")
        others = await _queue(ac, "team-a", 3) + await _queue(ac, "team-b", 3, "high")
        assert not any(t.done() for t in others) and ac.queued() == 9
        await _cancel(flood[:1])  # one of flood's clients left: it may queue one again
        flood = flood[1:] + await _queue(ac, "flood", 1)
        assert not flood[-1].done() and ac.queued("normal") == 6
        await _cancel(flood + others)
        assert ac.queued() == 0
    asyncio.run(main())


@pytest.mark.parametrize("policy", POLICIES)
def test_band_bound_still_holds_for_a_single_flooding_uncapped_tenant(policy):
    """Alone in its band a tenant's equal share is the whole band: it stops at the band's
    bound even below its own."""
    async def main():
        ac = AdmissionController(capacity=1, max_queued=5, policy=policy,
                                 max_queued_per_tenant=100)
        await ac.acquire("flood", "normal")
        flood = await _queue(ac, "flood", 5)
        with pytest.raises(QueueFull) as refused:
            await ac.acquire("flood", "normal")
        assert refused.value.reason == "band"
        assert str(refused.value) == ("is at capacity and the normal-priority queue is full; "
                                      "retry shortly")
        await _cancel(flood)
    asyncio.run(main())


@pytest.mark.parametrize("policy", POLICIES)
def test_a_full_band_refuses_only_tenants_holding_their_equal_share(policy):
    """`flood` fills the band (6 of 6). `team-a`, a newcomer, gets in and may catch up to
    `flood` (below the average of the band's waiting requests), then both are refused; a third
    tenant still gets in. The band stays within tenants x the largest backlog."""
    async def main():
        ac = AdmissionController(capacity=1, max_queued=6, policy=policy)
        await ac.acquire("x", "normal")  # fills the capacity
        waiting = await _queue(ac, "flood", 6)
        waiting += await _queue(ac, "team-a", 6)
        assert not any(t.done() for t in waiting) and ac.queued("normal") == 12
        for tenant in ("flood", "team-a"):
            with pytest.raises(QueueFull) as refused:
                await ac.acquire(tenant, "normal")
            assert refused.value.reason == "band"
        waiting += await _queue(ac, "team-c", 1)
        assert not waiting[-1].done() and ac.queued("normal") == 13
        h = await _queue(ac, "team-h", 1, "high")  # the other bands are not full
        await _cancel(waiting + h)
    asyncio.run(main())


def test_a_band_bound_of_zero_still_means_no_waiting():
    async def main():
        ac = AdmissionController(capacity=1, max_queued=0)
        await ac.acquire("a", "normal")
        for tenant in ("a", "b"):
            with pytest.raises(QueueFull):
                await ac.acquire(tenant, "normal")
        assert ac.queued() == 0
    asyncio.run(main())


def test_queue_full_stays_compatible_with_one_argument():
    exc = QueueFull("low")
    assert exc.band == "low" and exc.reason == "band" and "low-priority queue is full" in str(exc)


def test_per_tenant_bound_default_and_validation_name_the_field():
    assert RouterSettings().max_queued_per_tenant == 1024
    assert AdmissionController(1, 10).max_queued_per_tenant == 1024  # the config's default
    base = {"models": [{"name": "m1", "path": "x", "device": "cpu"}],
            "router": {"max_queued_per_tenant": 0}}
    with pytest.raises(ConfigError, match="router.max_queued_per_tenant"):
        parse_config(base)


@pytest.mark.parametrize("policy", POLICIES)
def test_queues_count_waiting_per_band_and_tenant(policy):
    from serve_app.governance.fair_queue import QUEUE_POLICIES

    q = QUEUE_POLICIES[policy]()
    for item, tenant, band in (("a1", "a", "normal"), ("a2", "a", "normal"), ("a3", "a", "high"),
                               ("b1", "b", "normal")):
        q.push(item, tenant, band)
    assert (q.waiting("normal", "a"), q.waiting(None, "a"), q.waiting("normal")) == (2, 3, 3)
    assert (q.tenants_waiting("normal"), q.tenants_waiting("high"), q.waiting("low", "a")) \
        == (2, 1, 0)
    q.remove("b1")
    assert q.pop() in ("a1", "a3") and q.remove("a2")
    assert q.waiting(None, "a") == 1 and q.waiting(None, "b") == 0 and len(q) == 1
    assert q.tenants_waiting("normal") + q.tenants_waiting("high") == 1
