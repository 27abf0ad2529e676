"""Keys -> tenants and per-tenant quotas (pure logic, a fake clock)."""

from __future__ import annotations

import pytest

from serve_app.config import ConfigError, TenantSettings, parse_config
from serve_app.governance.keys import ANONYMOUS, KeyRing, key_digest, new_key
from serve_app.governance.quota import QuotaBook, TokenBucket

KEY_A, KEY_B = new_key(), new_key()


def tenant(name: str, *keys: str, **limits) -> TenantSettings:
    return TenantSettings(name=name, api_key_sha256=[key_digest(k) for k in keys], **limits)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_new_keys_are_distinct_and_long():
    keys = {new_key() for _ in range(100)}
    assert len(keys) == 100 and all(len(k) >= 40 for k in keys)


def test_keyring_resolves_bearer_keys_to_tenants():
    ring = KeyRing([tenant("a", KEY_A), tenant("b", KEY_B)])
    assert ring.resolve(f"Bearer {KEY_A}").name == "a"
    assert ring.resolve(f"bearer {KEY_B}").name == "b"
    for bad in (None, "", "Bearer", "Bearer ", f"Basic {KEY_A}", KEY_A, "Bearer sk-sa-wrong",
                f"Bearer {KEY_A}x"):
        assert ring.resolve(bad) is None, bad


def test_open_keyring_makes_everyone_anonymous():
    ring = KeyRing([])
    assert ring.open
    assert ring.resolve(None).name == ANONYMOUS
    assert ring.resolve("Bearer anything").name == ANONYMOUS


def test_cache_salt_is_per_tenant_and_not_client_controlled():
    ring = KeyRing([tenant("a", KEY_A), tenant("b", KEY_B)])
    a, b = ring.resolve(f"Bearer {KEY_A}"), ring.resolve(f"Bearer {KEY_B}")
    assert a.cache_salt != b.cache_salt
    assert a.cache_salt == ring.resolve(f"Bearer {KEY_A}").cache_salt


def test_model_allow_list():
    ring = KeyRing([TenantSettings(name="a", api_key_sha256=[key_digest(KEY_A)],
                                   models=["m1"])])
    t = ring.resolve(f"Bearer {KEY_A}")
    assert t.may_use("m1") and not t.may_use("m2")


def test_config_stores_digests_not_keys():
    with pytest.raises(ValueError, match="SHA-256 hex digest"):
        TenantSettings(name="a", api_key_sha256=[KEY_A])


def test_config_rejects_shared_keys_duplicate_tenants_and_unknown_models():
    base = {"models": [{"name": "m1", "path": "x", "device": "cpu"}]}
    d = key_digest(KEY_A)
    for tenants, words in [
        ([{"name": "a", "api_key_sha256": [d]}, {"name": "b", "api_key_sha256": [d]}],
         "more than one tenant"),
        ([{"name": "a", "api_key_sha256": [d]},
          {"name": "a", "api_key_sha256": [key_digest(KEY_B)]}], "tenant names must be unique"),
        ([{"name": "a", "api_key_sha256": [d], "models": ["m2"]}], "not served"),
    ]:
        with pytest.raises(ConfigError, match=words):
            parse_config({**base, "tenants": tenants})


def test_bucket_refills_continuously_up_to_capacity():
    b = TokenBucket(60, 1.0, updated=0.0)
    b.take(60, 0.0)
    assert b.wait_for(1, 0.0) == pytest.approx(1.0)
    assert b.wait_for(1, 0.5) == pytest.approx(0.5)
    assert b.wait_for(30, 30.0) == 0.0
    assert b.wait_for(61, 1000.0) == pytest.approx(1.0)  # capped at capacity


def test_requests_per_minute_refuses_with_the_wait_until_a_slot_frees():
    clock = Clock()
    book = QuotaBook([tenant("a", KEY_A, requests_per_minute=3)], clock=clock)
    assert all(book.admit("a").admitted for _ in range(3))
    refused = book.admit("a")
    assert not refused.admitted and refused.limit == "requests_per_minute"
    assert refused.retry_after_s == pytest.approx(20.0)  # 3/min: one every 20 s
    assert "3 requests per minute" in refused.message
    clock.t += 20
    assert book.admit("a").admitted
    assert not book.admit("a").admitted


def test_tokens_per_minute_charges_usage_after_the_fact():
    clock = Clock()
    book = QuotaBook([tenant("a", KEY_A, tokens_per_minute=600)], clock=clock)
    assert book.admit("a").admitted
    book.settle("a", 900)  # overshoot: the request was already running
    refused = book.admit("a")
    assert not refused.admitted and refused.limit == "tokens_per_minute"
    assert refused.retry_after_s == pytest.approx(30.0, abs=0.01)  # 300 in debt at 10/s
    clock.t += 31
    assert book.admit("a").admitted


def test_tenants_are_independent_and_unlimited_by_default():
    clock = Clock()
    book = QuotaBook([tenant("a", KEY_A, requests_per_minute=1), tenant("b", KEY_B)],
                     clock=clock)
    assert book.admit("a").admitted and not book.admit("a").admitted
    assert all(book.admit("b").admitted for _ in range(1000))
    assert book.admit(ANONYMOUS).admitted


def test_share_splits_limits_between_router_replicas():
    clock = Clock()
    book = QuotaBook([tenant("a", KEY_A, requests_per_minute=10)], share=0.5, clock=clock)
    assert sum(book.admit("a").admitted for _ in range(10)) == 5


def test_cli_prints_a_key_and_a_config_entry_with_its_digest(capsys):
    import yaml

    from serve_app.cli import main

    assert main(["keys", "new", "team-x"]) == 0
    out = capsys.readouterr().out
    key = next(line.strip() for line in out.splitlines() if line.strip().startswith("sk-sa-"))
    entry = yaml.safe_load(out.split("deployment YAML:\n", 1)[1])["tenants"][0]
    assert entry["name"] == "team-x" and entry["api_key_sha256"] == [key_digest(key)]
    TenantSettings.model_validate(entry)  # pastes into a config as is
    assert KeyRing([TenantSettings.model_validate(entry)]).resolve(f"Bearer {key}").name == "team-x"


@pytest.mark.parametrize("router, words", [
    ({"queue_policy": "lifo"}, "router.queue_policy"),
    ({"max_in_flight_per_model": 0}, "router.max_in_flight_per_model"),
    ({"max_queued_per_band": -1}, "router.max_queued_per_band"),
])
def test_config_rejects_bad_router_queue_settings(router, words):
    base = {"models": [{"name": "m1", "path": "x", "device": "cpu"}], "router": router}
    with pytest.raises(ConfigError, match=words):
        parse_config(base)


def test_config_rejects_bad_tenant_fields():
    d = key_digest(KEY_A)
    for tenant, words in [({"name": "bad name", "api_key_sha256": [d]}, "tenants.0.name"),
                          ({"name": "a", "api_key_sha256": [d], "priority": "urgent"},
                           "tenants.0.priority"),
                          ({"name": "a", "api_key_sha256": [d], "requests_per_minute": 0},
                           "tenants.0.requests_per_minute"),
                          ({"name": "a", "api_key_sha256": []}, "tenants.0.api_key_sha256")]:
        with pytest.raises(ConfigError, match=words):
            parse_config({"models": [{"name": "m1", "path": "x", "device": "cpu"}],
                          "tenants": [tenant]})


def test_live_tenant_update_keeps_unchanged_buckets_and_drops_removed():
    """A redeploy must not refill anyone's quota; a changed limit applies at once; a removed
    tenant's state goes."""
    from serve_app.config import TenantSettings
    from serve_app.governance.quota import QuotaBook

    digest = "0" * 64
    now = [0.0]
    a = TenantSettings(name="a", api_key_sha256=[digest], requests_per_minute=2)
    b = TenantSettings(name="b", api_key_sha256=["1" * 64], requests_per_minute=2)
    book = QuotaBook([a, b], clock=lambda: now[0])
    assert book.admit("a").admitted and book.admit("a").admitted
    assert not book.admit("a").admitted  # a's bucket is empty
    book.update([a, b])  # the same limits: still empty
    assert not book.admit("a").admitted
    book.update([a.model_copy(update={"requests_per_minute": 60})])  # raised: applies now
    assert book.admit("a").admitted
    assert "b" not in book._rpm and "b" not in book._limits
