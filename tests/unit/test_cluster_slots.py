"""Concurrency caps for the whole app (issue 37, finding 5): slots leased from the quota actor
by demand, not split 1/N over the router replicas. The actor runs in-process behind the fake
handle of test_cluster_quota; the routers are real tenant gates and admission controllers."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.admission.controller import AdmissionController
from serve_app.config import AppConfig, ModelSettings, TenantSettings
from serve_app.governance import cluster_slots, quota_link
from serve_app.governance.quota_state import QuotaState
from serve_app.governance.tenants import TenantGate
from serve_app.governance import concurrency
from serve_app.governance.concurrency import SlotTable
from serve_app.governance.keys import key_digest, new_key
from tests.unit.test_cluster_quota import FakeActor, _until, store  # noqa: F401 (fixture)


def _tenant(name: str = "a", cap: int | None = 2) -> TenantSettings:
    return TenantSettings(name=name, api_key_sha256=[key_digest(new_key())],
                          max_concurrent_requests=cap)


@pytest.fixture(autouse=True)
def fast_rounds(monkeypatch):
    monkeypatch.setattr(cluster_slots, "SYNC_S", 0.01)


def _routers(n: int, tenants: list[TenantSettings], scope: str = "cluster"):
    """``n`` router replicas of one app: (gate, admission controller) each, on one actor."""
    cfg = AppConfig(models=[ModelSettings(name="m", path="m")], tenants=tenants,
                    router={"num_replicas": n}, governance={"quota_scope": scope})
    actor = FakeActor(QuotaState("llm", [t.model_dump(mode="json") for t in tenants]))
    out = []
    for _ in range(n):
        gate = TenantGate(cfg, app_name="llm")
        if gate.cluster is not None:
            gate.cluster._link.actor = actor
            gate.cluster._get_actor = lambda: actor
        out.append((gate, AdmissionController(capacity=100, max_queued=100, caps=gate.caps)))
    return out, actor


class Engines:
    """Counts a tenant's requests running over every router, and the most at once."""

    def __init__(self) -> None:
        self.running = 0
        self.peak = 0

    async def request(self, ac: AdmissionController, tenant: str = "a",
                      hold_s: float = 0.02) -> None:
        await ac.acquire(tenant, "normal")
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(hold_s)
        finally:
            self.running -= 1
            ac.release(tenant, 1)


def test_cap_of_2_over_4_routers_admits_2_regression_static_split(store):
    """Cap 2 over 4 routers: each enforced max(1, 2/4) = 1, so 4 ran at once. Now the actor
    leases 2 slots in all: 20 requests spread over the 4 never run more than 2 at once, and
    all of them finish (the slots move between the routers whose requests wait)."""
    routers, actor = _routers(4, [_tenant(cap=2)])
    engines = Engines()

    async def main():
        await asyncio.wait_for(asyncio.gather(
            *(engines.request(routers[i % 4][1]) for i in range(20))), 10)
        # All ended: every slot goes back and the routers stop calling.
        await _until(lambda: actor.state.slot_table.leased("a") == 0
                     and all(g.caps.slots._task.done() for g, _ in routers))
    asyncio.run(main())
    assert engines.peak == 2


def test_one_router_gets_the_whole_cap_regression_cap_over_n(store):
    """Cap 2 over 2 routers, every request on one of them (a client whose connection stays
    there): it ran 1 at a time (its half). It gets the whole cap now."""
    routers, _ = _routers(2, [_tenant(cap=2)])
    engines = Engines()

    async def main():
        await asyncio.wait_for(asyncio.gather(
            *(engines.request(routers[0][1]) for _ in range(8))), 10)
    asyncio.run(main())
    assert engines.peak == 2


def test_a_router_holding_a_free_slot_makes_no_call_per_request(store):
    routers, actor = _routers(2, [_tenant(cap=2)])
    engines = Engines()

    async def main():
        for _ in range(50):  # one at a time: the first call's slots serve them all
            await engines.request(routers[0][1], hold_s=0)
    asyncio.run(main())
    assert actor.calls <= 3 and engines.peak == 1


def test_idle_slots_go_back_and_reach_the_router_whose_requests_wait(store):
    routers, actor = _routers(2, [_tenant(cap=2)])
    (_, r1), (_, r2) = routers
    engines = Engines()

    async def main():
        await asyncio.gather(*(engines.request(r1, hold_s=0.01) for _ in range(2)))
        assert actor.state.slot_table.leased("a") == 2  # r1 still holds both, idle
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        waiting = [asyncio.create_task(r2.acquire("a", "normal")) for _ in range(2)]
        await _until(lambda: all(w.done() for w in waiting), timeout_s=1.0)
        assert loop.time() - t0 < 0.5  # a few rounds of SYNC_S (0.01 here), not SLOT_TTL_S
        assert actor.state.slot_table.leased("a") == 2
        for _ in waiting:
            r2.release("a", 1)
        await _until(lambda: actor.state.slot_table.leased("a") == 0)  # given back, idle
    asyncio.run(main())


def test_an_unreachable_actor_falls_back_to_the_share_within_a_second_then_reconciles(
        store, monkeypatch):
    monkeypatch.setattr(quota_link, "CALL_TIMEOUT_S", 0.1)
    monkeypatch.setattr(quota_link, "RETRY_S", 0.05)
    routers, actor = _routers(2, [_tenant(cap=4)])
    (g1, r1), _ = routers

    async def main():
        await r1.acquire("a", "normal")  # from the actor: r1 holds slots
        assert g1.caps.cap("a") == 4
        actor.hang = asyncio.Event()
        await asyncio.wait_for(asyncio.gather(*(r1.acquire("a", "normal") for _ in range(3))),
                               1)  # its 4 slots need no call; the fifth request would
        fifth = asyncio.create_task(r1.acquire("a", "normal"))
        await _until(lambda: g1.cluster.degraded, timeout_s=1.0)
        assert g1.caps.cap("a") == 2  # its share: 4 over 2 routers
        assert not fifth.done()  # 4 run, over the share: nothing more starts
        actor.hang.set()
        await _until(lambda: not g1.caps.slots.degraded, timeout_s=2.0)
        for _ in range(4):
            r1.release("a", 1)
        await asyncio.wait_for(fifth, 1)  # the actor's slots again
        assert actor.state.slot_table.leased("a") >= 1
    asyncio.run(main())


def test_replica_scope_keeps_the_static_split(store):
    routers, actor = _routers(4, [_tenant(cap=2)], scope="replica")
    assert [g.caps.cap("a") for g, _ in routers] == [1, 1, 1, 1]
    assert all(g.caps.slots is None for g, _ in routers)


def test_slot_table_never_leases_over_the_cap_and_rotates_between_waiting_routers():
    clock = [0.0]
    table = SlotTable([_tenant(cap=3)], clock=lambda: clock[0])
    used = {r: 0 for r in "wxyz"}
    limits = {r: 0 for r in "wxyz"}
    served = set()
    for step in range(200):
        clock[0] += 0.01
        r = "wxyz"[step % 4]
        if used[r] and step % 3 == 0:
            used[r] -= 1  # a request ended
        limits[r] = table.sync(r, {"a": [used[r], 3]})["a"]  # its requests wait: all of it
        used[r] = max(used[r], limits[r])  # it starts up to its limit
        if limits[r]:
            served.add(r)
        assert sum(used.values()) <= 3 and table.leased("a") <= 3
    assert served == set("wxyz")


def test_slot_table_frees_a_silent_routers_slots_and_forgets_a_removed_cap():
    clock = [0.0]
    table = SlotTable([_tenant(cap=2)], clock=lambda: clock[0])
    assert table.sync("x", {"a": [0, 2]}) == {"a": 2}
    assert table.sync("y", {"a": [0, 2]}) == {"a": 0}
    clock[0] += concurrency.SLOT_TTL_S + 0.1  # x died holding both
    assert table.sync("y", {"a": [0, 2]}) == {"a": 2}
    table.update([_tenant(cap=None)])
    assert table.sync("y", {"a": [2, 2]}) == {"a": None}


def test_a_slow_first_answer_runs_requests_on_the_share_meanwhile(store, monkeypatch):
    """A router's first call may create the actor (seconds): its requests do not wait for it
    past CALL_TIMEOUT_S; the answer, when it comes, counts what they run."""
    monkeypatch.setattr(quota_link, "CALL_TIMEOUT_S", 0.1)
    routers, actor = _routers(2, [_tenant(cap=4)])
    (g1, r1), _ = routers
    actor.delay_s = 0.5  # the actor's worker starting

    async def main():
        await asyncio.wait_for(r1.acquire("a", "normal"), 0.4)
        assert g1.caps.slots.degraded and g1.caps.cap("a") == 2  # the share, meanwhile
        await _until(lambda: not g1.caps.slots.degraded, timeout_s=2.0)
        assert actor.state.slot_table.leased("a") >= 1  # the running request counts there
        r1.release("a", 1)
    asyncio.run(main())


def test_a_slot_being_given_back_is_not_used_meanwhile(store):
    routers, actor = _routers(2, [_tenant(cap=2)])
    (g1, r1), (_, r2) = routers

    async def main():
        await asyncio.gather(r1.acquire("a", "normal"), r1.acquire("a", "normal"))
        r1.release("a", 1)
        r1.release("a", 1)
        actor.method_delay_s["lease_slots"] = 0.05  # every round stays on its way a while
        await _until(lambda: (g1.caps.slots._asking or {}).get("a", 2) < 2, timeout_s=1.0)
        assert g1.caps.cap("a") == 0  # what it gives back is not used while the call is out
        assert not g1.caps.may_start("a")
        actor.method_delay_s.clear()
        await asyncio.wait_for(asyncio.gather(r2.acquire("a", "normal"),
                                              r2.acquire("a", "normal")), 1)
        assert actor.state.slot_table.leased("a") == 2
        r2.release("a", 1)
        r2.release("a", 1)
    asyncio.run(main())


def test_an_actor_of_an_older_version_leaves_the_share_without_an_outage(store):
    """The quota actor is detached, so it outlives a deploy: one started before slots existed
    has no lease_slots. The routers keep their static share; its rate quota still answers."""
    routers, actor = _routers(2, [_tenant(cap=2)])
    (g1, r1), _ = routers

    class Older:
        def __getattr__(self, name):
            if name == "lease_slots":
                raise AttributeError(name)
            return getattr(actor, name)
    g1.cluster._link.actor = Older()

    async def main():
        await asyncio.wait_for(r1.acquire("a", "normal"), 1)
        await _until(lambda: g1.caps.slots.degraded)
        assert g1.caps.cap("a") == 1 and not g1.cluster.degraded
        r1.release("a", 1)
    asyncio.run(main())
