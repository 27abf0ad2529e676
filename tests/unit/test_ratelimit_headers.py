"""OpenAI's x-ratelimit-* headers from a tenant's buckets (pure logic, a fake clock)."""

from __future__ import annotations

import pytest

from serve_app.config import TenantSettings
from serve_app.governance.headers import LimitState, ratelimit_headers, reset_duration
from serve_app.governance.keys import key_digest, new_key
from serve_app.governance.quota import QuotaBook


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _tenant(**limits) -> TenantSettings:
    return TenantSettings(name="a", api_key_sha256=[key_digest(new_key())], **limits)


@pytest.mark.parametrize("seconds, text", [
    (0, "0s"), (-1, "0s"), (0.0004, "1ms"), (0.017, "17ms"), (0.9991, "1000ms"), (1, "1s"),
    (1.2, "2s"), (59, "59s"), (60, "1m0s"), (360, "6m0s"), (361.5, "6m2s"), (3600, "1h0m0s"),
    (3725, "1h2m5s"), (86400, "24h0m0s")])
def test_reset_is_written_as_openai_writes_it(seconds, text):
    assert reset_duration(seconds) == text


def test_remaining_requests_fall_by_one_per_request_and_reset_grows():
    clock = Clock()
    book = QuotaBook([_tenant(requests_per_minute=6, tokens_per_minute=1000)], clock=clock)
    seen = []
    for _ in range(6):
        assert book.admit("a").admitted
        seen.append(ratelimit_headers(*book.state("a")))
    assert [h["x-ratelimit-remaining-requests"] for h in seen] == ["5", "4", "3", "2", "1", "0"]
    assert {h["x-ratelimit-limit-requests"] for h in seen} == {"6"}
    # 6 per minute refills one every 10 s: k requests short of full reset in 10k s.
    assert [h["x-ratelimit-reset-requests"] for h in seen] == [
        "10s", "20s", "30s", "40s", "50s", "1m0s"]
    assert not book.admit("a").admitted
    assert ratelimit_headers(*book.state("a"))["x-ratelimit-remaining-requests"] == "0"
    clock.t += 10
    assert ratelimit_headers(*book.state("a"))["x-ratelimit-remaining-requests"] == "1"


def test_token_headers_count_the_unsettled_answer_and_debt_shows_as_zero():
    clock = Clock()
    book = QuotaBook([_tenant(tokens_per_minute=600)], clock=clock)
    h = ratelimit_headers(*book.state("a", pending_tokens=100))
    assert h == {"x-ratelimit-limit-tokens": "600", "x-ratelimit-remaining-tokens": "500",
                 "x-ratelimit-reset-tokens": "10s"}
    book.settle("a", 900)  # over the bucket: 300 tokens of debt, 90 s to full at 10/s
    h = ratelimit_headers(*book.state("a"))
    assert h["x-ratelimit-remaining-tokens"] == "0" and h["x-ratelimit-reset-tokens"] == "1m30s"


def test_a_limit_the_tenant_does_not_have_gets_no_headers():
    book = QuotaBook([_tenant()], clock=Clock())
    assert ratelimit_headers(*book.state("a")) == {}
    assert ratelimit_headers(*book.state("not-a-tenant")) == {}
    only_tokens = ratelimit_headers(None, LimitState(10, 3.9, 0.5))
    assert only_tokens == {"x-ratelimit-limit-tokens": "10", "x-ratelimit-remaining-tokens": "3",
                           "x-ratelimit-reset-tokens": "500ms"}


def _gate(scope: str, routers: int = 2, **limits):
    """A router replica's tenant gate (one of ``routers``) for tenant ``a``, on a fake clock."""
    from serve_app.config import AppConfig, ModelSettings
    from serve_app.governance.tenants import TenantGate

    cfg = AppConfig(models=[ModelSettings(name="m", path="m")], tenants=[_tenant(**limits)],
                    router={"num_replicas": routers}, governance={"quota_scope": scope})
    gate = TenantGate(cfg, app_name="llm" if scope == "cluster" else None)
    gate.quotas.clock = Clock()
    return gate


def test_headers_state_the_tenants_limit_not_the_routers_share_regression_replica_scope():
    """quota_scope: replica with 2 routers, a tenant of 6 RPM and 600 TPM: each router holds 3
    and 300, and its headers said so (limit 3, remaining 2 after one request), so a client
    read half its limit. The limit is the tenant's; remaining is the share scaled to it."""
    from serve_app.ingress.errors import OpenAIError
    from serve_app.governance.keys import Tenant

    gate, a = _gate("replica", requests_per_minute=6, tokens_per_minute=600), Tenant("a")
    full = gate.ratelimit_headers(a)
    assert full["x-ratelimit-limit-requests"] == "6" and full["x-ratelimit-limit-tokens"] == "600"
    assert full["x-ratelimit-remaining-requests"] == "6"
    assert full["x-ratelimit-remaining-tokens"] == "600"
    seen = []
    for _ in range(3):  # this router's share: 3 requests
        gate.admit(a)
        seen.append(gate.ratelimit_headers(a, pending_tokens=50))
    assert {h["x-ratelimit-limit-requests"] for h in seen} == {"6"}
    assert {h["x-ratelimit-limit-tokens"] for h in seen} == {"600"}
    # A third of the share per request: a third of the limit, if the other router's share
    # went as fast (the load balancer spreads the tenant over both).
    assert [h["x-ratelimit-remaining-requests"] for h in seen] == ["4", "2", "0"]
    assert seen[0]["x-ratelimit-remaining-tokens"] == "500"  # 300 - 50 of 300 -> 500 of 600
    # The reset is as before: this share refills 1 request in 20 s (3 a minute).
    assert [h["x-ratelimit-reset-requests"] for h in seen] == ["20s", "40s", "1m0s"]
    with pytest.raises(OpenAIError) as refused:
        gate.admit(a)
    assert refused.value.status_code == 429
    assert gate.ratelimit_headers(a)["x-ratelimit-remaining-requests"] == "0"


def test_headers_state_the_tenants_limit_not_the_routers_share_regression_quota_outage():
    """quota_scope: cluster, the quota actor unreachable: the router falls back to its local
    share (3 of 6 RPM over 2 routers) and its headers said limit 3. They state the tenant's
    limit, and remaining scaled from the share the router enforces now."""
    import asyncio

    from serve_app.governance.keys import Tenant

    class Down:
        def __getattr__(self, method):
            class Call:
                def remote(self, *args):
                    raise ConnectionError("actor lost")
            return Call()

    gate, a = _gate("cluster", requests_per_minute=6, tokens_per_minute=600), Tenant("a")
    gate.cluster._link.actor = Down()
    gate.cluster._get_actor = Down  # a lost actor stays lost

    async def main():
        await gate.acquire(a)
        assert gate.cluster.degraded and gate.cluster.state("a") is None  # the local share
        gate.charge_tokens(a, 30)
        first = gate.ratelimit_headers(a)
        await gate.acquire(a)
        second = gate.ratelimit_headers(a)
        return first, second
    first, second = asyncio.run(main())
    assert first["x-ratelimit-limit-requests"] == second["x-ratelimit-limit-requests"] == "6"
    assert first["x-ratelimit-limit-tokens"] == "600"
    assert first["x-ratelimit-remaining-requests"] == "4"
    assert second["x-ratelimit-remaining-requests"] == "2"
    assert first["x-ratelimit-remaining-tokens"] == "540"  # 270 of the 300 share


@pytest.mark.parametrize("routers, rpm, tpm", [(2, 6, 600), (2, 5, 50), (3, 7, 100), (2, 1, 10),
                                               (4, 3, 9)])
def test_remaining_above_zero_means_this_router_admits_the_next_request(routers, rpm, tpm):
    """The rule never overstates: whenever a share's headers say remaining > 0 for a limit,
    this router does not refuse the next request on that limit; and remaining never passes
    the limit. Shares that do not divide the limit (5 over 2) and a share under one request
    (1 RPM over 2 routers: a bucket of one) included."""
    clock = Clock()
    book = QuotaBook([_tenant(requests_per_minute=rpm, tokens_per_minute=tpm)],
                     share=1 / routers, clock=clock)
    for step in range(400):
        requests, tokens = book.state("a")
        assert requests.limit == rpm and tokens.limit == tpm
        assert requests.remaining <= rpm and tokens.remaining <= tpm
        said = ratelimit_headers(requests, tokens)
        decision = book.admit("a")
        if int(said["x-ratelimit-remaining-tokens"]) > 0:
            assert decision.limit != "tokens_per_minute", (step, said, decision)
        if int(said["x-ratelimit-remaining-requests"]) > 0:
            assert decision.limit != "requests_per_minute", (step, said, decision)
        if int(said["x-ratelimit-remaining-requests"]) > 0 and int(
                said["x-ratelimit-remaining-tokens"]) > 0:
            assert decision.admitted, (step, said, decision)
        if decision.admitted:
            book.settle("a", step % 7)
        clock.t += 0.7 + (step % 5) * 1.9


def test_the_whole_limit_in_one_router_is_stated_as_before():
    """One router (or the cluster quota's actor) holds the whole limit: remaining is the
    bucket's level, floored, as it always was."""
    clock = Clock()
    book = QuotaBook([_tenant(requests_per_minute=60, tokens_per_minute=100)], clock=clock)
    assert book.admit("a").admitted
    clock.t += 0.5  # half a request refilled: still 59
    h = ratelimit_headers(*book.state("a", pending_tokens=7))
    assert h["x-ratelimit-limit-requests"] == "60" and h["x-ratelimit-remaining-requests"] == "59"
    assert h["x-ratelimit-remaining-tokens"] == "93"
