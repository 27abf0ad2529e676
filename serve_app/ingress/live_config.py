"""The live part of a deployment's config: its tenants (keys, priorities, model access, quotas).

`serve-app deploy` writes them to the cluster's key-value store (Ray's GCS, which outlives any
replica); every router replica reads them before it authenticates its first request and then
every ``REFRESH_S`` in the background (never on a request's path), so a removed key is refused
within about a second everywhere, without restarting a router or an engine. A router replica that restarts (or is added) reads the same record, so a
revoked key never comes back with a replica. Everything else in the config (models, engine
arguments, router settings) is deployment structure: changing it redeploys (see
``serve_app.launch.deploy``).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from serve_app.config import TenantSettings

REFRESH_S = 1.0
_NAMESPACE = "serve_app"


def _key(app_name: str, what: str = "tenants") -> bytes:
    return f"{app_name}/{what}".encode()


def tenants_version(tenants: list[TenantSettings]) -> str:
    """A short digest of a tenant list (what `serve-app status` shows and routers compare)."""
    body = json.dumps([t.model_dump(mode="json") for t in tenants], sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()[:12]


def publish_tenants(app_name: str, tenants: list[TenantSettings]) -> str:
    """Make ``tenants`` the live tenant list of ``app_name`` (needs a connected Ray driver or
    worker); returns its version."""
    from ray.experimental.internal_kv import _internal_kv_put

    version = tenants_version(tenants)
    record = {"version": version, "tenants": [t.model_dump(mode="json") for t in tenants]}
    _internal_kv_put(_key(app_name), json.dumps(record).encode(), overwrite=True,
                     namespace=_NAMESPACE)
    return version


def read_tenants(app_name: str) -> tuple[str, list[TenantSettings]] | None:
    """The live tenant list of ``app_name`` and its version; None if none was published."""
    from ray.experimental.internal_kv import _internal_kv_get

    raw: Any = _internal_kv_get(_key(app_name), namespace=_NAMESPACE)
    if not raw:
        return None
    record = json.loads(raw)
    return record["version"], [TenantSettings.model_validate(t) for t in record["tenants"]]


def publish_config(app_name: str, config: dict[str, Any]) -> None:
    """Record the whole config last deployed as ``app_name`` (what `serve-app deploy` compares
    a new config with, and `serve-app status` reports)."""
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(_key(app_name, "config"), json.dumps(config).encode(), overwrite=True,
                     namespace=_NAMESPACE)


def read_config(app_name: str) -> dict[str, Any] | None:
    """The config last deployed as ``app_name`` (JSON form), or None."""
    from ray.experimental.internal_kv import _internal_kv_get

    raw: Any = _internal_kv_get(_key(app_name, "config"), namespace=_NAMESPACE)
    return json.loads(raw) if raw else None
