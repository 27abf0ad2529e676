"""A lease of many requests is counted in a fixed number of steps, with the result of one
:meth:`QuotaBook.admit` per request.

The quota actor's lease took a second's worth of a tenant's requests by calling ``admit`` once
each: at 10 million requests per minute, 166,667 calls, 130 ms on the actor. Every request
that found its router's lease expired (after 2 s idle) waited that long: the governed stack's
c=1 TTFT on one H200 was +68 ms over bare vLLM (median of pairs), its Server-Timing queue
130-337 ms after each idle gap (bench/RESULTS.md 37k)."""

from __future__ import annotations

import itertools

import pytest

from serve_app.config import TenantSettings
from serve_app.governance import quota_state
from serve_app.governance.keys import key_digest, new_key
from serve_app.governance.quota import QuotaBook


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _book(clock: Clock, **limits) -> QuotaBook:
    tenant = TenantSettings(name="t", api_key_sha256=[key_digest(new_key())], **limits)
    return QuotaBook([tenant], clock=clock)


LIMITS = [{"requests_per_minute": 6}, {"requests_per_minute": 600},
          {"requests_per_minute": 10**7}, {"tokens_per_minute": 500},
          {"requests_per_minute": 120, "tokens_per_minute": 500}]


@pytest.mark.parametrize("limits", LIMITS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_admit_many_grants_what_one_admit_per_request_would(limits):
    """Same grants, same refusal, same levels left, through spends, refills and overdrafts."""
    clocks = Clock(), Clock()
    many, one = _book(clocks[0], **limits), _book(clocks[1], **limits)
    for step, want in zip(itertools.count(), [1, 3, 50, 200_000, 7, 2, 10**6, 1]):
        for clock in clocks:
            clock.now += [0.0, 0.5, 3.0, 61.0][step % 4]
        if step == 3:  # tokens charged after the fact overdraw the token bucket
            many.settle("t", 600)
            one.settle("t", 600)
        granted, refusal = many.admit_many("t", want)
        expected, last = 0, None
        while expected < want:
            last = one.admit("t")
            if not last.admitted:
                break
            expected += 1
        assert granted == expected, (step, want)
        assert refusal.admitted == (granted == want)
        if not refusal.admitted:
            assert (refusal.limit, refusal.retry_after_s) == (last.limit, last.retry_after_s)
        assert many.state("t") == one.state("t")


def test_a_lease_at_ten_million_rpm_is_a_few_steps_regression_lease_counted_one_by_one(
        monkeypatch):
    """The actor's lease of 166,667 requests calls ``admit`` at most twice (it called it once
    per request: 130 ms that a request after an idle gap waited)."""
    monkeypatch.setattr(quota_state.serve_private, "kv_get", lambda key: None)
    monkeypatch.setattr(quota_state.serve_private, "kv_put", lambda key, value: None)
    monkeypatch.setattr(quota_state.live_config, "read_tenants", lambda app: None)
    tenant = TenantSettings(name="busy", api_key_sha256=[key_digest(new_key())],
                            requests_per_minute=10**7)
    state = quota_state.QuotaState("llm", [tenant.model_dump()])
    calls = 0
    admit = QuotaBook.admit

    def counted(self, name):
        nonlocal calls
        calls += 1
        return admit(self, name)

    monkeypatch.setattr(QuotaBook, "admit", counted)
    answer = state.lease("busy", 10**7 // 60, {}, {})
    assert answer["granted"] == 10**7 // 60
    assert calls <= 2


def _idle_router(monkeypatch, rpm: int):
    """One of two routers with ``rpm``'s lease taken by one request, then idle past the TTL,
    its lease flushed as the background flush does; and the fake actor (tests/unit/
    test_cluster_quota.py) counting calls."""
    from serve_app.governance import cluster_quota

    from .test_cluster_quota import FakeActor, _routers, _tenant

    store: dict = {}
    monkeypatch.setattr(quota_state.serve_private, "kv_put", store.__setitem__)
    monkeypatch.setattr(quota_state.serve_private, "kv_get", store.get)
    monkeypatch.setattr(quota_state.live_config, "read_tenants", lambda app: None)
    monkeypatch.setattr(cluster_quota, "LEASE_TTL_S", 0.0)  # every lease is past its TTL
    tenants = [_tenant(requests_per_minute=rpm)]
    actor = FakeActor(quota_state.QuotaState("llm", [t.model_dump(mode="json") for t in tenants]))
    router, _ = _routers(tenants, 2, actor)
    return router, actor


@pytest.mark.parametrize("rpm, calls_after_idle", [(6000, 0), (6, 1)])
def test_an_idle_tenants_next_request_makes_no_call_regression_lease_given_back_after_2s(
        monkeypatch, rpm, calls_after_idle):
    """6,000 a minute over two routers: a lease is 50 requests, a whole second of the rate;
    kept while idle, the next request is admitted from it without a call (every lease went
    back after 2 s, and the next request waited for a new one: bench/RESULTS.md 37k). 6 a
    minute: a lease is one request raised from a tenth, a sixth of the limit; it goes back."""
    import asyncio

    router, actor = _idle_router(monkeypatch, rpm)

    async def main() -> int:
        assert (await router.admit("a")).admitted
        charges, returns = router._take_unreported()  # the flush after the TTL
        if charges or returns:
            await router._link.call("report", charges, returns, ["a"])
        before = actor.calls
        assert (await router.admit("a")).admitted
        return actor.calls - before

    assert asyncio.run(main()) == calls_after_idle
