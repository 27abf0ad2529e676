"""The declarative path (KubeRay's RayService, `serve deploy`) publishes its tenants like
`serve-app deploy`: the routers and the quota actor follow the published list (pure; a fake
key-value store stands in for Ray's)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from serve_app.app import app_builder
from serve_app.config import APP_NAME
from serve_app.config.app import TENANTS_FILE_ENV
from serve_app.governance import live_config
from serve_app.governance.live_config import read_tenants
from serve_app.governance import audit
from serve_app.governance.audit import read_audit
from serve_app.governance.keys import key_digest, new_key

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "deployments" / "local-cpu.yaml")


@pytest.fixture
def kv(monkeypatch) -> dict[str, bytes]:
    store: dict[str, bytes] = {}
    for module in (live_config, audit):
        monkeypatch.setattr(module, "kv_put", store.__setitem__)
        monkeypatch.setattr(module, "kv_get", store.get)
    monkeypatch.setattr(audit, "kv_list", lambda p: [k for k in list(store) if k.startswith(p)])
    monkeypatch.setattr(audit, "kv_del", lambda k: store.pop(k, None))
    return store


def _secret(path: Path, rpm: int) -> None:
    path.write_text(yaml.safe_dump({"tenants": [
        {"name": "new-team", "api_key_sha256": [key_digest(KEY)], "requests_per_minute": rpm}]}))


KEY = new_key()


def test_a_tenant_added_to_the_secret_is_published_with_its_limit_regression_unlimited(
        kv, tmp_path, monkeypatch):
    """The app builder did not publish: a tenant added through the Secret had no limit in the
    quota actor (50 of 50 admitted against 6 per minute), a lowered limit kept its old value."""
    secret = tmp_path / "tenants.yaml"
    monkeypatch.setenv(TENANTS_FILE_ENV, str(secret))
    _secret(secret, 6)
    app_builder({"config": CONFIG})
    version, tenants = read_tenants(APP_NAME)
    assert [(t.name, t.requests_per_minute) for t in tenants] == [("new-team", 6)]
    first = read_audit(APP_NAME, last=10)
    assert [e["action"] for e in first] == ["rayservice"]
    assert [t["name"] for t in first[0]["added"]] == ["new-team"]
    assert KEY not in str(first) and key_digest(KEY) not in str(first)

    _secret(secret, 3)  # the Secret lowers the limit; the app is updated
    app_builder({"config": CONFIG})
    new_version, tenants = read_tenants(APP_NAME)
    assert new_version != version and tenants[0].requests_per_minute == 3
    changed = read_audit(APP_NAME, last=10)[-1]["changed"]
    assert changed == [{"name": "new-team", "before": {"requests_per_minute": 6},
                        "after": {"requests_per_minute": 3}, "keys_changed": False}]


def test_the_builder_run_again_for_the_same_config_adds_no_audit_record(kv, tmp_path,
                                                                       monkeypatch):
    secret = tmp_path / "tenants.yaml"
    monkeypatch.setenv(TENANTS_FILE_ENV, str(secret))
    _secret(secret, 6)
    app_builder({"config": CONFIG})
    app_builder({"config": CONFIG})
    assert len(read_audit(APP_NAME, last=10)) == 1
