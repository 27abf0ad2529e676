"""Tenants on the real stack: keys, quotas with Retry-After, model allow-lists, isolation."""

from __future__ import annotations

import random
import statistics

import httpx
import openai
import pytest
from openai import OpenAI

from serve_app.engine.timing import parse_server_timing

pytestmark = pytest.mark.integration


def _post(stack, key: str | None, *, authorization: str | None = None, **body):
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    if authorization is not None:
        headers["Authorization"] = authorization
    payload = {"model": stack["model"], "prompt": "hello", "max_tokens": 2, **body}
    return httpx.post(f"{stack['base']}/v1/completions", json=payload, headers=headers,
                      timeout=60)


def test_missing_or_wrong_key_is_401_and_never_echoed(stack):
    for key, auth in ((None, None), ("sk-sa-not-a-real-key", None),
                      (None, f"Basic {stack['key']}"), (None, "Bearer")):
        r = _post(stack, key, authorization=auth)
        assert r.status_code == 401, r.text
        err = r.json()["error"]
        assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
        assert "not-a-real-key" not in r.text
    r = httpx.get(f"{stack['base']}/v1/models", timeout=10)
    assert r.status_code == 401
    assert httpx.get(f"{stack['base']}/health", timeout=10).status_code == 200


def test_openai_client_with_a_bad_key_gets_authentication_error(stack):
    client = OpenAI(base_url=stack["base"] + "/v1", api_key="sk-sa-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model=stack["model"], prompt="hi", max_tokens=2)


def test_requests_per_minute_answers_429_with_retry_after_and_spares_others(stack):
    limited, other = stack["keys"]["rpm-limited"], stack["keys"]["team-b"]
    codes = [_post(stack, limited).status_code for _ in range(3)]
    assert codes == [200, 200, 200]
    r = _post(stack, limited)
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
    assert "3 requests per minute" in err["message"]
    retry = int(r.headers["retry-after"])
    assert 1 <= retry <= 20  # one request frees every 20 s at 3 per minute
    assert int(r.headers["retry-after-ms"]) <= retry * 1000
    # Another tenant is not affected, streamed or not.
    assert _post(stack, other).status_code == 200
    assert _post(stack, other, stream=True).status_code == 200
    # The official client sees a RateLimitError (and would wait Retry-After before retrying).
    client = OpenAI(base_url=stack["base"] + "/v1", api_key=limited, max_retries=0)
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=stack["model"], prompt="hi", max_tokens=2)


def test_tokens_per_minute_counts_prompt_and_completion_tokens(stack):
    key = stack["keys"]["tpm-limited"]  # 120 tokens per minute
    r = _post(stack, key, max_tokens=150, ignore_eos=True)  # admitted: the bucket is full
    assert r.status_code == 200, r.text
    used = r.json()["usage"]["total_tokens"]
    assert used > 150  # prompt + completion, charged when the request ended
    r = _post(stack, key)
    assert r.status_code == 429, r.text
    assert "120 tokens per minute" in r.json()["error"]["message"]
    # About (used - 120) tokens of debt at 2 tokens/s, plus the refill above zero.
    assert 1 <= int(r.headers["retry-after"]) <= (used - 120) / 2 + 2


def test_model_allow_list_hides_other_models(stack):
    key = stack["keys"]["no-models"]
    r = httpx.get(f"{stack['base']}/v1/models", headers={"Authorization": f"Bearer {key}"},
                  timeout=10)
    assert r.status_code == 200 and r.json()["data"] == []
    r = httpx.get(f"{stack['base']}/v1/models/{stack['model']}",
                  headers={"Authorization": f"Bearer {key}"}, timeout=10)
    assert r.status_code == 404
    r = _post(stack, key)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    # The same answer as for a model that is not served, listing none of the others' models.
    assert r.json()["error"]["message"].endswith("Available models: ")
    r = _post(stack, key, model="no-such-model")
    assert r.status_code == 404 and r.json()["error"]["message"].endswith("Available models: ")


def test_every_tenant_sees_the_same_outputs(stack):
    """The per-tenant cache salt changes no result: the same prompt, the same greedy output."""
    outs = set()
    for tenant in ("team-a", "team-b"):
        r = _post(stack, stack["keys"][tenant], prompt="The same prompt", max_tokens=8,
                  temperature=0)
        assert r.status_code == 200
        outs.add(r.json()["choices"][0]["text"])
    assert len(outs) == 1


PROMPT_TOKENS = 1500  # a prefill long enough that a cache hit shows in its time
TRIALS = 3
HIT_SPEED_UP = 3.0  # a hit's prefill is at least this much faster than the full one


def _prefill_ms(stack, tenant: str, prompt: list[int]) -> float:
    """The engine's prefill time (scheduled -> first token, from its Server-Timing header) of
    one request of ``tenant``: the phase a prefix-cache hit shortens, without the router's
    queue or the hops around it."""
    r = _post(stack, stack["keys"][tenant], prompt=prompt, max_tokens=1)
    assert r.status_code == 200, r.text
    return parse_server_timing(r.headers.get("server-timing"))["prefill"]


def test_a_tenants_cached_prefix_gives_another_tenant_no_speed_up(stack):
    """The timing side channel of a shared prefix cache (CVE-2025-46570): a prompt tenant A
    sent is cached, so A's second prefill of it is fast; tenant B's prefill of the same prompt
    must be as slow as a first one (the router salts the cache with the tenant). The control
    (A's own hit) shows the test can see a hit; fresh random prompts per trial, medians of
    TRIALS."""
    rng = random.Random()
    cold, warm, other = [], [], []
    for _ in range(TRIALS):
        prompt = [rng.randrange(10, 500) for _ in range(PROMPT_TOKENS)]
        cold.append(_prefill_ms(stack, "team-a", prompt))
        warm.append(_prefill_ms(stack, "team-a", prompt))
        other.append(_prefill_ms(stack, "team-b", prompt))
    cold_ms, warm_ms, other_ms = (statistics.median(x) for x in (cold, warm, other))
    seen = f"prefill ms: A first {cold}, A again {warm}, B {other}"
    assert cold_ms > HIT_SPEED_UP * warm_ms, f"no cache hit for A itself; {seen}"
    assert other_ms > HIT_SPEED_UP * warm_ms, f"B got A's cached prefix; {seen}"
