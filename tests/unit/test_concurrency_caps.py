"""Per-tenant max_concurrent_requests in admission (pure logic; asyncio for the controller)."""

from __future__ import annotations

import asyncio

from serve_app.admission.controller import AdmissionController
from serve_app.config import TenantSettings
from serve_app.governance.concurrency import ConcurrencyCaps
from serve_app.governance.fair_queue import FairQueue, FifoQueue
from serve_app.governance.keys import key_digest, new_key


def _tenant(name: str, cap: int | None = None) -> TenantSettings:
    return TenantSettings(name=name, api_key_sha256=[key_digest(new_key())],
                          max_concurrent_requests=cap)


def test_pop_skips_tenants_that_may_not_start():
    q: FairQueue[str] = FairQueue()
    q.push("a1", "a", "high")
    q.push("b1", "b", "normal")
    q.push("c1", "c", "normal")
    q.charge("b", 5)  # c has less service than b; a's band is higher than both
    assert q.pop(lambda t: t != "a") == "c1"  # a (high band) is capped: the normal band goes
    assert q.pop(lambda t: t not in ("a", "b")) is None
    assert q.pop() == "a1"
    fifo: FifoQueue[str] = FifoQueue()
    for item, tenant in (("x1", "x"), ("y1", "y"), ("x2", "x")):
        fifo.push(item, tenant)
    assert fifo.pop(lambda t: t != "x") == "y1"
    assert fifo.pop() == "x1" and len(fifo) == 1


def test_caps_split_over_routers_and_keep_at_least_one():
    caps = ConcurrencyCaps([_tenant("a", 5), _tenant("b", 1), _tenant("c")], share=0.5)
    assert caps.cap("a") == 2 and caps.cap("b") == 1 and caps.cap("c") is None


def test_a_capped_tenant_waits_instead_of_being_refused_and_never_passes_its_cap():
    async def main():
        caps = ConcurrencyCaps([_tenant("a", 2)])
        ac = AdmissionController(capacity=100, max_queued=100, caps=caps)
        started: list[int] = []
        peak = 0

        async def req(i: int) -> None:
            nonlocal peak
            await ac.acquire("a", "normal")
            started.append(i)
            peak = max(peak, caps.held["a"])

        tasks = [asyncio.create_task(req(i)) for i in range(6)]
        await asyncio.sleep(0)
        assert started == [0, 1] and ac.queued() == 4 and ac.tenant_in_flight["a"] == 2
        for _ in range(6):
            ac.release("a", 1)
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert started == list(range(6)) and peak == 2
        assert ac.in_flight == 0 and caps.held == {}
    asyncio.run(main())


def test_a_tenant_at_its_cap_does_not_hold_the_head_others_pass_it():
    async def main():
        caps = ConcurrencyCaps([_tenant("a", 1)])
        ac = AdmissionController(capacity=1, max_queued=100, caps=caps)
        await ac.acquire("b", "normal")  # fills the capacity
        a_waits = asyncio.create_task(ac.acquire("a", "high"))  # a would head the queue
        await asyncio.sleep(0)
        ac.release("b", 1)  # a starts and holds its cap
        await asyncio.sleep(0)
        assert a_waits.done() and caps.held == {"a": 1}
        a_again = asyncio.create_task(ac.acquire("a", "high"))
        b_next = asyncio.create_task(ac.acquire("b", "normal"))
        await asyncio.sleep(0)
        ac.set_capacity(2)  # room for one more: a's high-band request is capped, b goes
        await asyncio.sleep(0)
        assert b_next.done() and not a_again.done()
        ac.release("a", 1)  # a's first ended: its second starts (room again under capacity)
        ac.release("b", 1)
        await asyncio.sleep(0)
        assert a_again.done()
    asyncio.run(main())


def test_below_capacity_a_new_tenant_is_not_stuck_behind_capped_waiters():
    async def main():
        caps = ConcurrencyCaps([_tenant("a", 1)])
        ac = AdmissionController(capacity=10, max_queued=100, caps=caps)
        await ac.acquire("a", "normal")
        a2 = asyncio.create_task(ac.acquire("a", "normal"))
        await asyncio.sleep(0)
        assert ac.queued() == 1
        await asyncio.wait_for(ac.acquire("b", "normal"), 1)  # not queued behind a
        assert not a2.done()
        a2.cancel()
        await asyncio.gather(a2, return_exceptions=True)
    asyncio.run(main())


def test_the_cap_spans_models_and_a_release_on_one_admits_on_another():
    async def main():
        caps = ConcurrencyCaps([_tenant("a", 1)])
        m1 = AdmissionController(capacity=10, max_queued=100, caps=caps)
        m2 = AdmissionController(capacity=10, max_queued=100, caps=caps)
        await m1.acquire("a", "normal")
        on_m2 = asyncio.create_task(m2.acquire("a", "normal"))
        await asyncio.sleep(0)
        assert not on_m2.done()
        m1.release("a", 1)
        await asyncio.sleep(0)
        assert on_m2.done() and caps.held == {"a": 1}
    asyncio.run(main())


def test_a_request_weighs_its_n_and_one_above_the_cap_still_starts_alone():
    async def main():
        caps = ConcurrencyCaps([_tenant("a", 2)])
        ac = AdmissionController(capacity=100, max_queued=100, caps=caps)
        await asyncio.wait_for(ac.acquire("a", "normal", weight=4), 1)  # n=4 > cap: alone
        second = asyncio.create_task(ac.acquire("a", "normal", weight=1))
        await asyncio.sleep(0)
        assert caps.held == {"a": 4} and not second.done()
        ac.release("a", 1, weight=4)
        await asyncio.sleep(0)
        assert second.done() and caps.held == {"a": 1}
    asyncio.run(main())


def test_raising_a_cap_live_starts_waiters():
    async def main():
        caps = ConcurrencyCaps([_tenant("a", 1)])
        ac = AdmissionController(capacity=100, max_queued=100, caps=caps)
        await ac.acquire("a", "normal")
        waiting = asyncio.create_task(ac.acquire("a", "normal"))
        await asyncio.sleep(0)
        caps.update([_tenant("a", 2)])
        await asyncio.sleep(0)
        assert waiting.done()
    asyncio.run(main())
