"""One quota state per cluster: the actor's buckets, routers' leases, restarts, the fallback
(pure: the actor class runs in-process behind a fake handle, the key-value store is a dict)."""

from __future__ import annotations

import asyncio
import math

import pytest

from serve_app import serve_private
from serve_app.config import TenantSettings
from serve_app.governance import cluster_quota, live_config, quota_link, quota_state
from serve_app.governance.cluster_quota import ClusterQuota, QuotaState
from serve_app.governance.headers import ratelimit_headers
from serve_app.governance.keys import key_digest, new_key
from serve_app.governance.quota import QuotaBook


def _tenant(name: str = "a", **limits) -> TenantSettings:
    return TenantSettings(name=name, api_key_sha256=[key_digest(new_key())], **limits)


@pytest.fixture
def store(monkeypatch) -> dict:
    data: dict[str, bytes] = {}
    monkeypatch.setattr(serve_private, "kv_put", data.__setitem__)
    monkeypatch.setattr(serve_private, "kv_get", data.get)
    monkeypatch.setattr(live_config, "read_tenants", lambda app: None)
    monkeypatch.setattr(quota_state, "CHECKPOINT_S", 0.0)
    return data


class FakeActor:
    """A Ray actor handle over an in-process QuotaState: ``h.lease.remote(...)`` awaitable.
    One call at a time, in the order they started, as a (sync) Ray actor runs a caller's; a
    caller that stops waiting does not cancel the call (as with Ray). With ``hang`` set to an
    unset event, every call waits for it (a hung actor)."""

    def __init__(self, state: QuotaState) -> None:
        self.state = state
        self.calls = 0
        self.down = False
        self.delay_s = 0.0
        self.method_delay_s: dict[str, float] = {}
        self.lock: asyncio.Lock | None = None
        self.hang: asyncio.Event | None = None
        self.in_flight = 0
        self.most_in_flight = 0

    def __getattr__(self, name: str):
        method = getattr(self.state, name)
        outer = self

        class Method:
            def remote(self, *args):
                outer.calls += 1

                async def run():
                    outer.in_flight += 1
                    outer.most_in_flight = max(outer.most_in_flight, outer.in_flight)
                    try:
                        if outer.down:
                            raise ConnectionError("actor lost")
                        if outer.calls == 1:  # a fresh actor: its worker starting
                            await asyncio.sleep(outer.delay_s)
                        if outer.lock is None:
                            outer.lock = asyncio.Lock()
                        async with outer.lock:
                            if outer.hang is not None:
                                await outer.hang.wait()
                            await asyncio.sleep(outer.method_delay_s.get(name, 0.0))
                            return method(*args)
                    finally:
                        outer.in_flight -= 1
                return asyncio.shield(asyncio.ensure_future(run()))
        return Method()


async def _until(condition, timeout_s: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


class FakeGauge:
    def __init__(self) -> None:
        self.values: list[float] = []

    def set(self, value: float) -> None:
        self.values.append(value)


def _routers(tenants, n: int, actor: FakeActor) -> list[ClusterQuota]:
    out = []
    for _ in range(n):
        cq = ClusterQuota("llm", tenants, n, QuotaBook(tenants, share=1 / n))
        cq._link.actor = actor
        cq._get_actor = lambda: actor  # a lost actor comes back as the same handle here
        out.append(cq)
    return out


def test_two_routers_share_one_bucket_not_half_each(store):
    tenants = [_tenant(requests_per_minute=6)]
    actor = FakeActor(QuotaState("llm", [t.model_dump(mode="json") for t in tenants]))
    r1, r2 = _routers(tenants, 2, actor)

    async def main():
        one_router = [(await r1.admit("a")).admitted for _ in range(12)]
        assert one_router.count(True) == 6  # the whole limit through one replica
        spread = [(await r.admit("a")).admitted for r in (r1, r2) * 3]
        assert not any(spread)  # and nothing more through the other
        refusal = await r2.admit("a")
        assert refusal.limit == "requests_per_minute" and 0 < refusal.retry_after_s <= 10
    asyncio.run(main())


def test_leases_take_batches_so_most_requests_make_no_call(store):
    tenants = [_tenant(requests_per_minute=6000)]  # 100 a second: batches of 50 per router
    actor = FakeActor(QuotaState("llm", [t.model_dump(mode="json") for t in tenants]))
    r1, _ = _routers(tenants, 2, actor)

    async def main():
        for _ in range(100):
            assert (await r1.admit("a")).admitted
    asyncio.run(main())
    assert actor.calls == 2
    h = ratelimit_headers(*r1.state("a"))
    assert h["x-ratelimit-limit-requests"] == "6000"
    assert int(h["x-ratelimit-remaining-requests"]) == 5900  # falls by one per request


def test_a_restarted_router_and_a_restarted_actor_refill_nothing(store):
    tenants = [_tenant(requests_per_minute=6)]
    dumped = [t.model_dump(mode="json") for t in tenants]
    actor = FakeActor(QuotaState("llm", dumped))
    (r1,) = _routers(tenants, 1, actor)

    async def main():
        assert [(await r1.admit("a")).admitted for _ in range(4)] == [True] * 4
        (restarted,) = _routers(tenants, 1, actor)  # a new replica: no lease, same actor
        assert [(await restarted.admit("a")).admitted for _ in range(4)] == [
            True, True, False, False]
        # The actor lost and started again: its buckets come back from the checkpoint.
        reborn = FakeActor(QuotaState("llm", dumped))
        (r3,) = _routers(tenants, 1, reborn)
        assert not (await r3.admit("a")).admitted
    asyncio.run(main())


def test_tokens_are_charged_cluster_wide_and_seen_at_once_by_the_charging_router(store):
    tenants = [_tenant(tokens_per_minute=600)]
    actor = FakeActor(QuotaState("llm", [t.model_dump(mode="json") for t in tenants]))
    r1, r2 = _routers(tenants, 2, actor)

    async def main():
        assert (await r1.admit("a")).admitted
        r1.settle("a", 700)  # over the whole limit: r1 knows at once
        refusal = await r1.admit("a")
        assert not refusal.admitted and refusal.limit == "tokens_per_minute"
        assert math.isclose(refusal.retry_after_s, 10, abs_tol=0.5)  # 100 in debt at 10/s
        assert not (await r2.admit("a")).admitted  # r2 asks the actor, which knows
    asyncio.run(main())


def test_an_unreachable_actor_falls_back_to_the_local_share_then_recovers(store, monkeypatch):
    monkeypatch.setattr(quota_link, "RETRY_S", 0.05)
    tenants = [_tenant(requests_per_minute=6)]
    actor = FakeActor(QuotaState("llm", [t.model_dump(mode="json") for t in tenants]))
    r1, _ = _routers(tenants, 2, actor)

    async def main():
        actor.down = True
        local = [(await r1.admit("a")).admitted for _ in range(5)]
        assert local == [True, True, True, False, False] and r1.degraded  # its share: 3
        await asyncio.sleep(0.06)
        actor.down = False
        assert not (await r1.admit("a")).admitted  # still its share; a probe goes behind it
        await _until(lambda: not r1.degraded)
        assert (await r1.admit("a")).admitted  # the actor again
    asyncio.run(main())


def test_a_spent_tenant_stays_spent_when_the_actor_is_lost_regression_outage_refilled_shares(
        store, monkeypatch):
    """The shares a replica falls back to start from the actor's last word: a tenant that
    spent its limit through the actor gets nothing more from them (they started full, so
    losing the actor gave every tenant its whole limit again). A replica that had not served
    the tenant starts its share full (the documented bound); a tenant with room left gets 1/N
    of it, and the room comes back as the shares refill."""
    monkeypatch.setattr(quota_link, "RETRY_S", 60.0)
    tenants = [_tenant("spent", requests_per_minute=6, tokens_per_minute=600),
               _tenant("room", requests_per_minute=60)]
    actor = FakeActor(QuotaState("llm", [t.model_dump(mode="json") for t in tenants]))
    r1, r2 = _routers(tenants, 2, actor)

    async def main():
        assert [(await r1.admit("spent")).admitted for _ in range(6)] == [True] * 6
        assert not (await r1.admit("spent")).admitted  # the actor: none left
        for _ in range(20):
            assert (await r1.admit("room")).admitted  # 40 left of 60 (less r1's lease)
        actor.down = True
        refused = await r1.admit("spent")
        assert r1.degraded and not refused.admitted, refused
        assert refused.limit == "requests_per_minute"
        # room: 1/2 of what the actor said was left (about 40), plus r1's unused lease.
        room = [(await r1.admit("room")).admitted for _ in range(30)]
        assert 18 <= room.count(True) <= 22, room.count(True)
        # r2 never served `spent`: its share starts full (3 of 6).
        await r2.admit("room")  # r2 finds the actor lost
        assert r2.degraded
        assert [(await r2.admit("spent")).admitted for _ in range(4)] == [True] * 3 + [False]
    asyncio.run(main())


def test_unlimited_tenants_never_call_the_actor(store):
    tenants = [_tenant("free")]
    actor = FakeActor(QuotaState("llm", [t.model_dump(mode="json") for t in tenants]))
    (r1,) = _routers(tenants, 1, actor)

    async def main():
        for _ in range(10):
            assert (await r1.admit("free")).admitted
    asyncio.run(main())
    assert actor.calls == 0 and r1.state("free") is None


def test_a_slow_first_answer_is_waited_for_regression_every_router_fell_back_at_start(
        store, monkeypatch):
    """A fresh actor's worker takes seconds to start: with the 1 s call bound on the first
    call too, every router replica fell back to its share (seen: 3 of RPM 6 through one of two
    routers). Later calls keep the short bound."""
    monkeypatch.setattr(quota_link, "CALL_TIMEOUT_S", 0.05)
    monkeypatch.setattr(quota_link, "STARTUP_TIMEOUT_S", 2.0)
    tenants = [_tenant(requests_per_minute=6)]
    actor = FakeActor(QuotaState("llm", [t.model_dump(mode="json") for t in tenants]))
    r1, _ = _routers(tenants, 2, actor)

    async def main():
        actor.delay_s = 0.2
        assert [(await r1.admit("a")).admitted for _ in range(6)] == [True] * 6
        assert not r1.degraded
        assert not (await r1.admit("a")).admitted  # the whole limit: 6, not a share of 3
    asyncio.run(main())


def test_charges_on_their_way_to_the_actor_still_count_regression_tpm_admitted_over(store):
    """The flush took a finished request's tokens off the replica's count when it sent them,
    before the answer came: a request arriving meanwhile saw the old token level and none of
    those tokens, and was admitted over the limit (test_tenancy's TPM test got 200, not 429)."""
    tenants = [_tenant(tokens_per_minute=120)]
    actor = FakeActor(QuotaState("llm", [t.model_dump(mode="json") for t in tenants]))
    (r1,) = _routers(tenants, 1, actor)

    async def main():
        assert (await r1.admit("a")).admitted
        r1.settle("a", 152)
        actor.method_delay_s["report"] = 0.2
        charges, returns = r1._take_unreported()  # what the flush does, then its call
        flush = asyncio.ensure_future(r1._link.call("report", charges, returns, ["a"]))
        await asyncio.sleep(0.05)
        refusal = await r1.admit("a")
        assert not refusal.admitted and refusal.limit == "tokens_per_minute"
        r1._seen(await flush)
        r1._reported(charges, ok=True)
        assert r1._leases["a"].sending == 0 and not (await r1.admit("a")).admitted
    asyncio.run(main())


def test_hung_quota_actor_releases_waiters_at_once_regression_serialised_timeouts(
        store, monkeypatch):
    """An actor that hangs (rather than fails): the tenant's requests queued behind the call
    on its lock each called it again when their turn came, one full time-out after another
    (1, 2, 3 ... 10 s), as the degraded flag was not looked at again. Now one call is in
    flight; when it times out every waiter takes the local share at once, none calls the
    actor; one probe later finds it back and the state reconciles (usage charged during the
    outage reaches the actor, leases resume)."""
    monkeypatch.setattr(quota_link, "RETRY_S", 1.0)  # CALL_TIMEOUT_S as deployed: 1 s
    gauge = FakeGauge()
    monkeypatch.setattr(quota_link, "_degraded_gauge", lambda: gauge)
    tenants = [_tenant(requests_per_minute=60, tokens_per_minute=600)]  # leases of one
    actor = FakeActor(QuotaState("llm", [t.model_dump(mode="json") for t in tenants]))
    (r1,) = _routers(tenants, 1, actor)

    async def main():
        assert (await r1.admit("a")).admitted and not r1.degraded  # the actor answered
        actor.hang = asyncio.Event()
        actor.most_in_flight = 0
        loop = asyncio.get_running_loop()
        started = loop.time()
        answers = await asyncio.gather(*(r1.admit("a") for _ in range(10)))
        took = loop.time() - started
        assert took < 1.5, f"10 requests waited {took:.2f} s on a hung actor"
        assert r1.degraded and gauge.values[-1] == 1
        assert actor.most_in_flight == 1, actor.most_in_flight  # one call, never one each
        assert [a.admitted for a in answers].count(True) >= 1  # from the local share
        calls = actor.calls
        r1.settle("a", 300)  # charged during the outage: must reach the actor
        assert (await r1.admit("a")) is not None and actor.calls == calls  # no new call
        actor.hang.set()  # the actor answers again
        await _until(lambda: not r1.degraded)
        assert gauge.values[-1] == 0
        assert actor.calls == calls + 1  # the one probe
        level = actor.state.book._tpm["a"].level
        assert level < 600 - 300 + 40, level  # the outage's usage is in the actor's bucket
        assert r1._leases["a"].unflushed == r1._leases["a"].sending == 0
        assert (await r1.admit("a")).admitted and actor.calls == calls + 2  # a lease again
    asyncio.run(main())


def test_failing_quota_actor_is_called_once_per_outage_regression_serialised_timeouts(
        store, monkeypatch):
    """An actor that fails at once: the tenant's waiters each called it again in turn. Now
    the first failure begins the outage and the waiters take the local share without a
    call of their own."""
    monkeypatch.setattr(quota_link, "RETRY_S", 60.0)
    tenants = [_tenant(requests_per_minute=60)]
    actor = FakeActor(QuotaState("llm", [t.model_dump(mode="json") for t in tenants]))
    (r1,) = _routers(tenants, 1, actor)

    async def main():
        assert (await r1.admit("a")).admitted
        actor.down = True
        calls = actor.calls
        answers = await asyncio.gather(*(r1.admit("a") for _ in range(10)))
        assert all(a.admitted for a in answers) and r1.degraded
        assert actor.calls == calls + 1, actor.calls - calls
    asyncio.run(main())


def test_a_slow_report_does_not_add_calls_to_a_slow_actor(store, monkeypatch):
    """The batched report waits while a call is slow to be answered (single flight): with a
    hung actor, the flush adds no call beside the tenant's lease call."""
    monkeypatch.setattr(quota_link, "CALL_TIMEOUT_S", 0.6)
    monkeypatch.setattr(cluster_quota, "FLUSH_S", 0.05)
    monkeypatch.setattr(quota_link, "RETRY_S", 60.0)
    tenants = [_tenant(requests_per_minute=60)]
    actor = FakeActor(QuotaState("llm", [t.model_dump(mode="json") for t in tenants]))
    (r1,) = _routers(tenants, 1, actor)

    async def main():
        assert (await r1.admit("a")).admitted
        r1.settle("a", 10)
        actor.hang = asyncio.Event()
        calls = actor.calls
        await r1.admit("a")
        assert r1.degraded and actor.calls == calls + 1
    asyncio.run(main())
