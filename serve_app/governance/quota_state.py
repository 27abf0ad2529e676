"""The cluster's quota state: one Ray actor per app (detached, named ``<app>-quota``) that
holds each tenant's request and token buckets at their full size (a :class:`QuotaBook` of share
1 on the wall clock). Router replicas reach it through :class:`~serve_app.governance.cluster_quota.
ClusterQuota`, which takes leases from it and reports token usage in batches (the error bound
and the failure rule are in that module's docstring).

It follows the live tenant list in the cluster's key-value store (the record the routers
follow, :func:`serve_app.governance.live_config.read_tenants`), and checkpoints its buckets there
at most every ``CHECKPOINT_S``; an actor that is lost and started again (Ray restarts it, or a
router's next call creates it) restores them, refilled for the time passed. It also leases the
tenants' concurrency slots (:class:`~serve_app.governance.concurrency.SlotTable`; the routers'
side is :mod:`serve_app.governance.cluster_slots`), and keeps every router's fair-share service
per model and tenant (:class:`~serve_app.governance.fair_share_sync.ServiceTable`, in the same
checkpoint), so that each router's fair queue orders tenants by the app's service. It is a plain
class (the routers wrap it with ``ray.remote``), so unit tests run it in-process.
"""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Any

from serve_app import serve_private
from serve_app.config import TenantSettings
from serve_app.governance import live_config
from serve_app.governance.concurrency import SlotTable
from serve_app.governance.fair_share_sync import ServiceTable
from serve_app.governance.quota import QuotaBook

logger = logging.getLogger(__name__)

NAMESPACE = "serve_app"
CHECKPOINT_S = 1.0
TENANTS_REFRESH_S = 1.0


def actor_name(app_name: str) -> str:
    return f"{app_name}-quota"


def _checkpoint_key(app_name: str) -> str:
    return f"{app_name}/quota/checkpoint"


def _snapshot(book: QuotaBook, tenant: str) -> dict[str, Any]:
    """The tenant's buckets as the routers need them: [capacity, level, rate] or None."""
    now = book.clock()
    out: dict[str, Any] = {}
    for kind, buckets in (("rpm", book._rpm), ("tpm", book._tpm)):
        b = buckets.get(tenant)
        if b is None:
            out[kind] = None
        else:
            b.wait_for(0, now)  # refill to now
            out[kind] = [b.capacity, b.level, b.rate]
    return out


class QuotaState:
    """The cluster's quota state (run as a Ray actor; see the module docstring). Methods are
    called by router replicas; each applies the caller's token ``charges`` and unused lease
    ``returns`` first."""

    def __init__(self, app_name: str, tenants: list[dict[str, Any]]) -> None:
        self.app_name = app_name
        settings = [TenantSettings.model_validate(t) for t in tenants]
        self.book = QuotaBook(settings, clock=time.time)
        self.slot_table = SlotTable(settings)
        self.version: str | None = None
        self._tenants_read = 0.0
        self._checkpointed = 0.0
        self._restore: dict[str, Any] | None = self._read_checkpoint()
        try:
            self.service = ServiceTable(state=(self._restore or {}).get("service"))
        except (KeyError, TypeError, AttributeError, ValueError):
            logger.exception("fair-share checkpoint unreadable; its totals start anew")
            self.service = ServiceTable()
        self._refresh_tenants(force=True)

    # -- persistence ----------------------------------------------------------------------------
    def _read_checkpoint(self) -> dict[str, Any] | None:
        try:
            raw = serve_private.kv_get(_checkpoint_key(self.app_name))
            return json.loads(raw) if raw else None
        except Exception:
            logger.exception("quota checkpoint unreadable; starting with full buckets")
            return None

    def _apply_checkpoint(self) -> None:
        """Put the checkpointed levels back into buckets whose limits are unchanged (they
        refill for the time since, as they would have)."""
        if not self._restore:
            return
        for kind, buckets in (("rpm", self.book._rpm), ("tpm", self.book._tpm)):
            for tenant, (capacity, level, updated) in self._restore.get(kind, {}).items():
                b = buckets.get(tenant)
                if b is not None and math.isclose(b.capacity, capacity):
                    b.level, b.updated = level, updated
        self._restore = None

    def _checkpoint(self) -> None:
        now = time.time()
        if now - self._checkpointed < CHECKPOINT_S:
            return
        self._checkpointed = now
        state: dict[str, Any] = {
            kind: {t: [b.capacity, b.level, b.updated] for t, b in buckets.items()}
            for kind, buckets in (("rpm", self.book._rpm), ("tpm", self.book._tpm))}
        state["service"] = self.service.state()
        try:
            serve_private.kv_put(_checkpoint_key(self.app_name), json.dumps(state).encode())
        except Exception:
            logger.exception("quota checkpoint failed")

    def _refresh_tenants(self, force: bool = False) -> None:
        """Follow the live tenant list (the record `serve-app deploy` publishes)."""
        now = time.time()
        if not force and now - self._tenants_read < TENANTS_REFRESH_S:
            return
        self._tenants_read = now
        try:
            live = live_config.read_tenants(self.app_name)
        except Exception:
            logger.exception("live tenant list unreadable; keeping the current limits")
            live = None
        if live is not None and live[0] != self.version:
            self.version = live[0]
            self.book.update(live[1])
            self.slot_table.update(live[1])
        self._apply_checkpoint()

    # -- the routers' calls --------------------------------------------------------------------
    def _apply(self, charges: dict[str, int], returns: dict[str, int]) -> None:
        self._refresh_tenants()
        for tenant, tokens in charges.items():
            self.book.settle(tenant, tokens)
        for tenant, unused in returns.items():
            for _ in range(unused):
                self.book.refund(tenant)
            bucket = self.book._rpm.get(tenant)
            if bucket is not None:  # a lease given back never lifts a bucket past full
                bucket.level = min(bucket.level, bucket.capacity)

    def lease(self, tenant: str, want: int, charges: dict[str, int],
              returns: dict[str, int]) -> dict[str, Any]:
        """Take up to ``want`` requests of ``tenant`` (at least one if any is free): the answer
        says how many were ``granted``; with none, ``retry_after_s``, ``limit`` and
        ``message`` of the refusal; and ``snapshot``, the buckets of ``tenant`` and of every
        tenant charged, after it."""
        self._apply(charges, returns)
        granted, refusal = self.book.admit_many(tenant, want)
        self._checkpoint()
        return {"granted": granted, "retry_after_s": refusal.retry_after_s,
                "limit": refusal.limit, "message": refusal.message,
                "snapshot": {t: _snapshot(self.book, t) for t in {tenant, *charges}}}

    def report(self, charges: dict[str, int], returns: dict[str, int],
               tenants: list[str], service: dict[str, Any] | None = None) -> dict[str, Any]:
        """Apply a replica's charges and returns; the buckets of ``tenants`` after them. With
        ``service`` (a :meth:`~serve_app.governance.fair_share_sync.FairShareSync.outgoing`
        report), the answer is ``{"buckets": those buckets, "service": the exchange's answer
        (:meth:`share_service`)}``."""
        self._apply(charges, returns)
        shared = None if service is None else self.share_service(service)
        self._checkpoint()
        buckets = {t: _snapshot(self.book, t) for t in tenants}
        return buckets if shared is None else {"buckets": buckets, "service": shared}

    def share_service(self, service: dict[str, Any]) -> dict[str, Any]:
        """A router's fair-share report: its cumulative service per model and tenant; the
        answer, the other routers' (:meth:`~serve_app.governance.fair_share_sync.ServiceTable.
        report`). Its presence tells a router this actor takes ``service`` in :meth:`report`."""
        return self.service.report(service["router"], service["epoch"], service["base"],
                                   service["service"])

    def lease_slots(self, router: str, report: dict[str, list[int]]) -> dict[str, int | None]:
        """Concurrency slots: ``report`` is tenant -> [sequences in flight, slots wanted] of
        router replica ``router`` (an id it chose); the answer, tenant -> the slots it may use
        now (:meth:`serve_app.governance.concurrency.SlotTable.sync`)."""
        self._refresh_tenants()
        return self.slot_table.sync(router, report)
