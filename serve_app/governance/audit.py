"""The audit trail: one entry per change of an app's tenants or config (`serve-app run` and
`deploy`, and the RayService's app builder): when, who (OS user and host), the config's version,
and which tenants were added, removed and changed, by name and limits. Never a key digest: a
tenant whose keys changed says so and how many it has.

Append-only: each entry is its own record in the cluster's key-value store, under a key that
sorts by its time (``<app>/audit/<ns since the epoch>-<random>``), so deploys at the same moment
from two places both stay (the earlier single read-modify-write value dropped one of them). An
append removes the records older than the retention (``governance.audit_retention_days``);
nothing else deletes one. `serve-app status` shows the last few. Written by the deploying
process, which reads the live list it replaces.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import secrets
import socket
import time
from datetime import datetime, timezone
from typing import Any

from serve_app.config import TenantSettings
from serve_app.serve_private import kv_del, kv_get, kv_list, kv_put

# The retention when the caller names none (governance.audit_retention_days's default).
DEFAULT_RETENTION_DAYS = 365
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


def _prefix(app_name: str) -> str:
    return f"{app_name}/audit/"


def _legacy_key(app_name: str) -> str:
    """The one value earlier releases kept the last 200 entries in (read, never written)."""
    return f"{app_name}/audit"


def _written_ns(key: str) -> int:
    """When the record under ``key`` was written (ns since the epoch; 0 if unreadable)."""
    stamp = key.rsplit("/", 1)[-1].split("-", 1)[0]
    return int(stamp) if stamp.isdigit() else 0


def append_audit(app_name: str, entry: dict[str, Any],
                 retention_days: float = DEFAULT_RETENTION_DAYS) -> None:
    """Add ``entry`` to ``app_name``'s trail as a record of its own (needs Ray), and remove the
    records older than ``retention_days``. Never reads or rewrites another record, so
    concurrent appends all stay."""
    now_ns = time.time_ns()
    kv_put(f"{_prefix(app_name)}{now_ns:020d}-{secrets.token_hex(4)}",
           json.dumps(entry).encode())
    oldest = now_ns - int(retention_days * 86400e9)
    for key in kv_list(_prefix(app_name)):
        if _written_ns(key) < oldest:
            kv_del(key)


def read_audit(app_name: str, last: int = 5) -> list[dict[str, Any]]:
    """The last ``last`` entries of ``app_name``'s trail, oldest first (needs Ray); entries an
    earlier release kept in one value come before every record."""
    if last <= 0:
        return []
    keys = sorted(kv_list(_prefix(app_name)))[-last:]
    entries = [json.loads(raw) for raw in map(kv_get, keys) if raw]
    if len(entries) < last:
        raw = kv_get(_legacy_key(app_name))
        legacy = json.loads(raw) if raw else []
        entries = legacy[-(last - len(entries)):] + entries if legacy else entries
    return entries
