"""The audit log's entries: tenants added, removed and changed, never a digest (pure; a fake
key-value store)."""

from __future__ import annotations

import json
import threading
from datetime import datetime, timezone

from serve_app.config import TenantSettings
from serve_app.governance import audit
from serve_app.governance.audit import (append_audit, audit_entry, read_audit,
                                           tenant_changes)
from serve_app.governance.keys import key_digest, new_key

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


class FakeKV:
    """Ray's KV store as the audit module uses it; ``on_get`` runs after every read, before
    the value is returned (where a concurrent writer can slip in)."""

    def __init__(self, monkeypatch) -> None:
        self.data: dict[str, bytes] = {}
        self.on_get = lambda: None
        monkeypatch.setattr(audit, "kv_put", self.data.__setitem__)
        monkeypatch.setattr(audit, "kv_get", self.get)
        monkeypatch.setattr(audit, "kv_list", lambda prefix: [k for k in list(self.data)
                                                              if k.startswith(prefix)])
        monkeypatch.setattr(audit, "kv_del", lambda key: self.data.pop(key, None))

    def get(self, key: str) -> bytes | None:
        value = self.data.get(key)
        self.on_get()
        return value


def _entry(i: int, now: datetime | None = None) -> dict:
    return audit_entry("live", {"i": i}, f"v{i}", [], [_t("a", DIGEST_A)], now=now)


def test_entries_are_read_back_newest_last(monkeypatch):
    FakeKV(monkeypatch)
    now = datetime(2026, 12, 3, 12, tzinfo=timezone.utc)
    for i in range(5):
        append_audit("llm", _entry(i, now))
    entries = read_audit("llm", last=3)
    assert [e["tenants_version"] for e in entries] == ["v2", "v3", "v4"]
    assert read_audit("llm", last=1)[0]["tenants_version"] == "v4"
    assert len(read_audit("llm", last=10)) == 5
    e = entries[0]
    assert e["time"] == "2026-12-03T12:00:00+00:00" and "@" in e["operator"]
    assert e["action"] == "live" and len(e["config_version"]) == 12
    assert read_audit("other") == [] and read_audit("llm", last=0) == []


def test_concurrent_deploys_both_stay_in_the_audit_trail_regression_read_modify_write(
        monkeypatch):
    """Two deploys append at the same moment. The trail was one value read, extended and
    written back: both read it before either wrote, and one entry was lost."""
    kv = FakeKV(monkeypatch)
    both_read = threading.Barrier(2, timeout=1)

    def wait_for_the_other() -> None:
        try:
            both_read.wait()
        except threading.BrokenBarrierError:
            pass  # an append that reads nothing does not meet the other at all

    kv.on_get = wait_for_the_other
    threads = [threading.Thread(target=append_audit, args=("llm", _entry(i))) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    kv.on_get = lambda: None
    assert sorted(e["tenants_version"] for e in read_audit("llm", last=10)) == ["v0", "v1"]


def test_records_past_the_retention_are_removed_at_the_next_append(monkeypatch):
    FakeKV(monkeypatch)
    day_ns = 86400 * 10**9
    clock = [1_800_000_000 * 10**9]
    monkeypatch.setattr(audit.time, "time_ns", lambda: clock[0])
    append_audit("llm", _entry(0), retention_days=30)
    clock[0] += 10 * day_ns
    append_audit("llm", _entry(1), retention_days=30)
    clock[0] += 25 * day_ns  # the first is 35 days old now, the second 25
    append_audit("llm", _entry(2), retention_days=30)
    assert [e["tenants_version"] for e in read_audit("llm", last=10)] == ["v1", "v2"]


def test_entries_of_the_earlier_single_value_come_first(monkeypatch):
    kv = FakeKV(monkeypatch)
    kv.data["llm/audit"] = json.dumps([_entry(0), _entry(1)]).encode()
    append_audit("llm", _entry(2))
    assert [e["tenants_version"] for e in read_audit("llm", last=10)] == ["v0", "v1", "v2"]
    assert [e["tenants_version"] for e in read_audit("llm", last=2)] == ["v1", "v2"]
