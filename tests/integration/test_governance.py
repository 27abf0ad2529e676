"""Tenant governance on the real stack (issue 29): OpenAI's rate-limit headers on every
authenticated answer (JSON, SSE, 429)."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.integration

RATE_HEADERS = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
                "x-ratelimit-reset-requests", "x-ratelimit-limit-tokens",
                "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens")


def _post(stack, tenant: str, **body) -> httpx.Response:
    payload = {"model": stack["model"], "prompt": "hello", "max_tokens": 3, **body}
    return httpx.post(f"{stack['base']}/v1/completions", json=payload, timeout=60,
                      headers={"Authorization": f"Bearer {stack['keys'][tenant]}"})


def test_rate_limit_headers_on_json_sse_and_429_fall_by_one_per_request(stack):
    """Tenant `headers`: 4 requests per minute, 100000 tokens per minute."""
    answers = [_post(stack, "headers"), _post(stack, "headers", stream=True),
               _post(stack, "headers"), _post(stack, "headers", stream=True),
               _post(stack, "headers")]
    assert [r.status_code for r in answers] == [200, 200, 200, 200, 429]
    assert answers[1].headers["content-type"].startswith("text/event-stream")
    for r in answers:
        missing = [h for h in RATE_HEADERS if h not in r.headers]
        assert not missing, (r.status_code, missing)
        assert r.headers["x-ratelimit-limit-requests"] == "4"
        assert r.headers["x-ratelimit-limit-tokens"] == "100000"
    remaining = [int(r.headers["x-ratelimit-remaining-requests"]) for r in answers]
    assert remaining == [3, 2, 1, 0, 0], remaining
    # 4 per minute: one every 15 s; a bucket k requests short is full in about 15k s.
    assert answers[0].headers["x-ratelimit-reset-requests"] in ("15s", "14s")
    assert answers[3].headers["x-ratelimit-reset-requests"] in ("1m0s", "59s")
    assert answers[4].json()["error"]["code"] == "rate_limit_exceeded"
    assert "retry-after" in answers[4].headers
    # A JSON answer's token figures count its own tokens: the first left 100000 - its usage.
    used = answers[0].json()["usage"]["total_tokens"]
    assert int(answers[0].headers["x-ratelimit-remaining-tokens"]) == 100000 - used
