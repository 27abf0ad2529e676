"""OpenAI's x-ratelimit-* headers from a tenant's buckets (pure logic, a fake clock)."""

from __future__ import annotations

import pytest

from serve_app.config import TenantSettings
from serve_app.tenancy.headers import LimitState, ratelimit_headers, reset_duration
from serve_app.tenancy.keys import key_digest, new_key
from serve_app.tenancy.quota import QuotaBook


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


def test_headers_report_this_routers_share_of_a_limit():
    book = QuotaBook([_tenant(requests_per_minute=60)], share=0.5, clock=Clock())
    assert book.admit("a").admitted
    h = ratelimit_headers(*book.state("a"))
    assert h["x-ratelimit-limit-requests"] == "30" and h["x-ratelimit-remaining-requests"] == "29"
