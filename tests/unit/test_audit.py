"""The audit log's entries: tenants added, removed and changed, never a digest (pure; a fake
key-value store)."""

from __future__ import annotations

import json
from datetime import datetime, timezone

from serve_app.config import TenantSettings
from serve_app.observability import audit
from serve_app.observability.audit import (append_audit, audit_entry, read_audit,
                                           tenant_changes)
from serve_app.tenancy.keys import key_digest, new_key

DIGEST_A, DIGEST_A2, DIGEST_B = (key_digest(new_key()) for _ in range(3))


def _t(name: str, *digests: str, **limits) -> TenantSettings:
    return TenantSettings(name=name, api_key_sha256=list(digests), **limits)


def test_added_removed_and_changed_tenants_by_name_and_limits_never_digests():
    before = [_t("a", DIGEST_A, requests_per_minute=60), _t("b", DIGEST_B),
              _t("gone", key_digest(new_key()))]
    after = [_t("a", DIGEST_A2, requests_per_minute=120), _t("b", DIGEST_B),
             _t("new", key_digest(new_key()), token_budget={"tokens": 10, "period": "day"})]
    changes = tenant_changes(before, after)
    assert changes["removed"] == ["gone"]
    assert [t["name"] for t in changes["added"]] == ["new"]
    assert changes["added"][0]["token_budget"] == {"tokens": 10, "period": "day"}
    assert changes["added"][0]["keys"] == 1
    assert changes["changed"] == [{"name": "a", "before": {"requests_per_minute": 60},
                                   "after": {"requests_per_minute": 120},
                                   "keys_changed": True}]
    text = json.dumps(changes)
    for digest in (DIGEST_A, DIGEST_A2, DIGEST_B):
        assert digest not in text


def test_first_deploy_adds_every_tenant_and_an_unchanged_one_is_not_listed():
    same = [_t("a", DIGEST_A)]
    assert tenant_changes(None, same)["added"][0]["name"] == "a"
    assert tenant_changes(same, same) == {"added": [], "removed": [], "changed": []}


def test_entries_keep_the_last_ones_in_the_store(monkeypatch):
    store: dict[str, bytes] = {}
    monkeypatch.setattr(audit, "kv_put", store.__setitem__)
    monkeypatch.setattr(audit, "kv_get", store.get)
    monkeypatch.setattr(audit, "KEEP", 3)
    now = datetime(2026, 12, 3, 12, tzinfo=timezone.utc)
    for i in range(5):
        append_audit("llm", audit_entry("live", {"i": i}, f"v{i}", [], [_t("a", DIGEST_A)],
                                        now=now))
    entries = read_audit("llm", last=10)
    assert [e["tenants_version"] for e in entries] == ["v2", "v3", "v4"]
    assert read_audit("llm", last=1)[0]["tenants_version"] == "v4"
    e = entries[0]
    assert e["time"] == "2026-12-03T12:00:00+00:00" and "@" in e["operator"]
    assert e["action"] == "live" and len(e["config_version"]) == 12
    assert read_audit("other") == []
