"""The live part of a deployment's config: its tenants (keys, priorities, model access, quotas)
and each model's LoRA adapters (names, paths, owners: :mod:`serve_app.governance.adapters`).

`serve-app deploy` writes them to the cluster's key-value store (Ray's GCS, which outlives any
replica); every router replica reads them before it authenticates its first request and then
every ``REFRESH_S`` in the background (never on a request's path), so a removed key is refused
within about a second everywhere, without restarting a router or an engine. A router replica that restarts (or is added) reads the same record, so a
revoked key never comes back with a replica. Everything else in the config (models, engine
arguments, router settings) is deployment structure: changing it redeploys (see
``serve_app.launch.deploy``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from serve_app.config import AppConfig, TenantSettings
from serve_app.governance.adapters import AdapterTable
from serve_app.serve_private import kv_get, kv_put

if TYPE_CHECKING:
    from serve_app.governance.tenants import TenantGate
    from serve_app.governance.keys import Tenant

logger = logging.getLogger(__name__)

REFRESH_S = 1.0


def _key(app_name: str, what: str = "tenants") -> str:
    return f"{app_name}/{what}"


def tenants_version(tenants: list[TenantSettings]) -> str:
    """A short digest of a tenant list (what `serve-app status` shows and routers compare)."""
    body = json.dumps([t.model_dump(mode="json") for t in tenants], sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()[:12]


def publish_tenants(app_name: str, tenants: list[TenantSettings]) -> str:
    """Make ``tenants`` the live tenant list of ``app_name`` (needs a connected Ray driver or
    worker); returns its version."""
    version = tenants_version(tenants)
    record = {"version": version, "tenants": [t.model_dump(mode="json") for t in tenants]}
    kv_put(_key(app_name), json.dumps(record).encode())
    return version


def read_tenants(app_name: str) -> tuple[str, list[TenantSettings]] | None:
    """The live tenant list of ``app_name`` and its version; None if none was published."""
    raw = kv_get(_key(app_name))
    if not raw:
        return None
    record = json.loads(raw)
    return record["version"], [TenantSettings.model_validate(t) for t in record["tenants"]]


def adapters_of(config: AppConfig) -> dict[str, list[dict[str, Any]]]:
    """Each model's adapters as the live record holds them (model name -> adapter entries)."""
    return {m.name: [a.model_dump(mode="json") for a in m.adapters] for m in config.models}


def adapters_version(adapters: dict[str, list[dict[str, Any]]]) -> str:
    """A short digest of an adapter record (what routers compare)."""
    return hashlib.sha256(json.dumps(adapters, sort_keys=True).encode()).hexdigest()[:12]


def publish_adapters(app_name: str, config: AppConfig) -> str:
    """Make ``config``'s adapters the live ones of ``app_name``; returns their version."""
    adapters = adapters_of(config)
    version = adapters_version(adapters)
    kv_put(_key(app_name, "adapters"), json.dumps({"version": version,
                                                   "models": adapters}).encode())
    return version


def read_adapters(app_name: str) -> tuple[str, dict[str, list[dict[str, Any]]]] | None:
    """The live adapters of ``app_name`` (model name -> entries) and their version; None if
    none were published."""
    raw = kv_get(_key(app_name, "adapters"))
    if not raw:
        return None
    record = json.loads(raw)
    return record["version"], record["models"]


def _read_live(app_name: str) -> tuple[Any, Any]:
    """Both live records in one thread hop: (tenants, adapters), each None if unpublished."""
    return read_tenants(app_name), read_adapters(app_name)


def publish_config(app_name: str, config: dict[str, Any]) -> None:
    """Record the whole config last deployed as ``app_name`` (what `serve-app deploy` compares
    a new config with, and `serve-app status` reports)."""
    kv_put(_key(app_name, "config"), json.dumps(config).encode())


def read_config(app_name: str) -> dict[str, Any] | None:
    """The config last deployed as ``app_name`` (JSON form), or None."""
    raw = kv_get(_key(app_name, "config"))
    return json.loads(raw) if raw else None


def record_deploy(app_name: str, config: AppConfig, action: str) -> str:
    """Every deploy path's one step before its app goes live (`serve-app run` and `deploy`,
    and the RayService's app builder): publish ``config`` as the deployed one and its tenants
    as the live list, which the routers and the quota actor follow, and append an audit record
    naming the tenants it changed (``action``: start, live, redeploy or rayservice). Returns
    the tenant list's version. Needs a connected Ray driver or worker.

    The audit record is skipped when neither the config nor the tenants changed (an app
    builder that runs again for the same config), and a failed audit write is logged, never
    raised: the change is made, and a lost record must not undo or hide it."""
    from serve_app.governance.audit import audit_entry, append_audit

    before = read_tenants(app_name)
    dumped = config.model_dump(mode="json")
    unchanged = read_config(app_name) == dumped and before is not None \
        and before[0] == tenants_version(config.tenants)
    publish_config(app_name, dumped)
    # Adapters before tenants: a router that reads between the two writes sees new adapters
    # with the old tenants, and refuses a pair that does not validate (an owner not yet a
    # tenant) until the tenants follow a second later, never the other way round.
    publish_adapters(app_name, config)
    version = publish_tenants(app_name, config.tenants)
    if unchanged:
        return version
    try:
        append_audit(app_name, audit_entry(action, dumped, version,
                                           before[1] if before else None, config.tenants),
                     config.governance.audit_retention_days)
    except Exception:
        logger.exception("could not write the audit record of this deploy")
    return version


class LiveTenants:
    """One router replica's copy of the live tenant list, kept current in the background.

    :meth:`authenticate` is the pipeline's first step: it returns once the list has been read
    at least once by this replica (a replica started after a tenant change must not accept a
    revoked key even once), then resolves the key. The first call starts the task that re-reads
    the list every ``REFRESH_S``: the store read (a thread hop and a GCS round trip) used to run
    inline on every request that found the list a second old, which at c=1 was most of them,
    on their time to first token. Single-threaded (the router's event loop)."""

    def __init__(self, config: AppConfig, gate: TenantGate, app_name: str) -> None:
        self.config = config
        self.gate = gate
        self.app_name = app_name
        self.version = tenants_version(config.tenants)
        self.adapters_version = adapters_version(adapters_of(config))
        self.adapters = AdapterTable.from_config(config)
        self._checked = 0.0
        self._task: asyncio.Task[None] | None = None
        self._read = asyncio.Event()

    async def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant of an ``Authorization`` header by the current list, or a 401."""
        await self.current()
        return self.gate.authenticate(authorization)

    async def current(self) -> None:
        """Return once the live list has been read at least once (free after that)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._keep_current())
        if not self._read.is_set():
            await self._read.wait()

    async def _keep_current(self) -> None:
        """Re-read the live tenant list every REFRESH_S, for the life of the replica."""
        while True:
            try:
                await self.refresh(force=True)
            except Exception:  # never let the refresher die: the next round tries again
                logger.exception("live tenant refresh failed")
            self._read.set()
            await asyncio.sleep(REFRESH_S)

    async def refresh(self, force: bool = False) -> None:
        """Adopt the live tenant list if a deploy published a new one (unless ``force``, at
        most one store read per REFRESH_S; a record that does not validate against this app is
        refused and logged, and the current tenants stay)."""
        now = time.monotonic()
        if not force and now - self._checked < REFRESH_S:
            return
        self._checked = now
        try:
            live, adapters = await asyncio.to_thread(_read_live, self.app_name)
        except Exception:
            logger.warning("could not read the live tenant list; keeping %s", self.version,
                           exc_info=True)
            return
        live = live if live is not None and live[0] != self.version else None
        adapters = (adapters if adapters is not None and adapters[0] != self.adapters_version
                    else None)
        if live is None and adapters is None:
            return
        data = self.config.model_dump(mode="json")
        if live is not None:
            data["tenants"] = [t.model_dump(mode="json") for t in live[1]]
        if adapters is not None:
            for m in data["models"]:
                m["adapters"] = adapters[1].get(m["name"], [])
        try:
            config = AppConfig.model_validate(data)
        except ValidationError as err:
            logger.error("live tenants %s / adapters %s refused, keeping %s / %s: %s",
                         live and live[0], adapters and adapters[0], self.version,
                         self.adapters_version, err)
            return
        self.config = config
        if live is not None:
            self.gate.set_tenants(config.tenants)
            logger.info("tenants: version %s -> %s (%d tenants)", self.version, live[0],
                        len(config.tenants))
            self.version = live[0]
        if adapters is not None:
            self.adapters = AdapterTable.from_config(config)
            logger.info("adapters: version %s -> %s (%d adapters)", self.adapters_version,
                        adapters[0], len(self.adapters))
            self.adapters_version = adapters[0]

    async def state(self) -> dict[str, Any]:
        """The tenant list this router replica enforces now (version and names), and the
        adapters it serves (version and names)."""
        await self.refresh()
        return {"version": self.version, "tenants": [t.name for t in self.config.tenants],
                "adapters_version": self.adapters_version,
                "adapters": [a.name for m in self.config.models for a in m.adapters]}
