"""The audit log: one entry per `serve-app deploy` (and stack start) of an app: when, who (OS
user and host), the config's version, and which tenants were added, removed and changed, by name
and limits. Never a key digest: a tenant whose keys changed says so and how many it has.

Entries live in the cluster's key-value store beside the live tenant list (the last
:data:`KEEP` of them, newest last), so every operator sees the same history; `serve-app status`
shows the last few. Written by the deploying process, which reads the live list it replaces.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import socket
from datetime import datetime, timezone
from typing import Any

from serve_app.config import TenantSettings
from serve_app.serve_private import kv_get, kv_put

KEEP = 200
# What an entry may show of a tenant: everything but its key digests.
_SECRET_FIELDS = {"api_key_sha256"}


def config_version(config: dict[str, Any]) -> str:
    """A short digest of a whole config (JSON form)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]


def limits_of(tenant: TenantSettings) -> dict[str, Any]:
    """A tenant as the audit log shows it: its settings without key digests, and how many
    keys it has."""
    shown = tenant.model_dump(mode="json", exclude=_SECRET_FIELDS)
    shown.pop("name")
    shown["keys"] = len(tenant.api_key_sha256)
    return shown


def tenant_changes(before: list[TenantSettings] | None, after: list[TenantSettings]
                   ) -> dict[str, Any]:
    """Tenants ``added`` (name and limits), ``removed`` (names) and ``changed`` (name, the
    fields that changed, before and after; ``keys_changed`` when its key digests did) from
    ``before`` (None: nothing was live) to ``after``."""
    old = {t.name: t for t in before or []}
    new = {t.name: t for t in after}
    changed = []
    for name in sorted(old.keys() & new.keys()):
        a, b = limits_of(old[name]), limits_of(new[name])
        fields = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        keys_changed = set(old[name].api_key_sha256) != set(new[name].api_key_sha256)
        if fields or keys_changed:
            changed.append({"name": name, "before": {k: a.get(k) for k in fields},
                            "after": {k: b.get(k) for k in fields},
                            "keys_changed": keys_changed})
    return {"added": [{"name": n, **limits_of(new[n])} for n in sorted(new.keys() - old.keys())],
            "removed": sorted(old.keys() - new.keys()), "changed": changed}


def operator() -> str:
    """Who runs this process: ``user@host``."""
    try:
        user = getpass.getuser()
    except Exception:  # no login name (a container without a passwd entry)
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def audit_entry(action: str, config: dict[str, Any], tenants_version: str,
                before: list[TenantSettings] | None, after: list[TenantSettings],
                now: datetime | None = None) -> dict[str, Any]:
    """One entry: ``action`` (``start``, ``live`` or ``redeploy``), time (UTC), operator,
    config and tenant versions, and :func:`tenant_changes`."""
    when = (now or datetime.now(timezone.utc)).isoformat(timespec="seconds")
    return {"time": when, "operator": operator(), "action": action,
            "config_version": config_version(config), "tenants_version": tenants_version,
            **tenant_changes(before, after)}


def _key(app_name: str) -> str:
    return f"{app_name}/audit"


def append_audit(app_name: str, entry: dict[str, Any]) -> None:
    """Add ``entry`` to ``app_name``'s log, keeping the last :data:`KEEP` (needs Ray). Deploys
    are run by people, rarely at the same instant; two at once could drop one entry."""
    kv_put(_key(app_name), json.dumps((read_audit(app_name, KEEP) + [entry])[-KEEP:]).encode())


def read_audit(app_name: str, last: int = 5) -> list[dict[str, Any]]:
    """The last ``last`` entries of ``app_name``'s log, oldest first (needs Ray)."""
    raw = kv_get(_key(app_name))
    entries = json.loads(raw) if raw else []
    return entries[-last:] if last > 0 else []
