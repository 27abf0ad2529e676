"""Token budgets' spend in the cluster's key-value store (Ray's GCS), for every router replica.

Each router replica writes its own spend of a (tenant, window) under
``<app>/budget/<tenant>/<window>/<replica>`` and reads every record of the window back, in the
background every ``SYNC_S`` (never on a request's path). The records outlive router replicas and
redeploys, so neither refills a budget; they live as long as the GCS does (a head node restarted
without GCS fault tolerance loses them, as it loses the live tenant list), or until their window
has passed: each router replica deletes every record of a past window (any tenant's, any
replica's, tenants removed since included) when it first syncs and whenever a window ends, so
the store holds one record per tenant, current window and router replica, not one per day
forever. Only windows *before* the replica's current one are deleted: a replica whose clock
lags never deletes a record another has started for the next day.

:meth:`BudgetSync.ready` is awaited before a request's quota check: a router replica that just
started (or just got a tenant with a budget) reads the store once before it admits anyone with a
budget, so a restart never lets a spent tenant through. When the store cannot be read, budgets
are enforced on what this replica knows (fail open, logged): billing must not take the endpoint
down.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime, timezone
from typing import Any

from serve_app.config import TenantSettings
from serve_app.serve_private import kv_del, kv_get, kv_list, kv_put
from serve_app.governance.budget import BudgetBook, past_window, window_of

logger = logging.getLogger(__name__)

SYNC_S = 1.0


def _root(app_name: str) -> str:
    return f"{app_name}/budget/"


def _prefix(app_name: str, tenant: str, window: str) -> str:
    return f"{_root(app_name)}{tenant}/{window}/"


def read_spend(app_name: str, tenant: str, window: str) -> dict[str, int]:
    """Router replica id -> its recorded spend of ``tenant``'s ``window`` (needs Ray)."""
    prefix = _prefix(app_name, tenant, window)
    out: dict[str, int] = {}
    for key in kv_list(prefix):
        raw = kv_get(key)
        try:
            out[key[len(prefix):]] = int(raw or b"0")
        except ValueError:
            logger.warning("budget record %s is not a number; ignored", key)
    return out


def write_spend(app_name: str, tenant: str, window: str, replica: str, tokens: int) -> None:
    kv_put(_prefix(app_name, tenant, window) + replica, str(tokens).encode())


def current_windows(now: float) -> dict[int, str]:
    """The current window id of each period, by the id's length (``day``'s are longer)."""
    ids = (window_of(period, now)[0] for period in ("day", "month"))
    return {len(w): w for w in ids}


def prune_spend(app_name: str, now: float) -> int:
    """Delete every budget record of a window before the current one (needs Ray); returns how
    many were deleted. Records whose key does not parse are left alone."""
    current = current_windows(now)
    root = _root(app_name)
    deleted = 0
    for key in kv_list(root):
        parts = key[len(root):].split("/")
        if len(parts) != 3:
            continue
        window = parts[1]
        now_id = current.get(len(window))
        if now_id is not None and past_window(window, now_id):
            kv_del(key)
            deleted += 1
    return deleted


def budget_report(app_name: str, tenants: list[TenantSettings],
                  now: float | None = None) -> dict[str, dict[str, Any]]:
    """What `serve-app status` shows per tenant with a budget: tokens, period, spent and left
    in the current window, and when it resets (UTC). Needs a connected Ray driver."""
    now = time.time() if now is None else now
    report: dict[str, dict[str, Any]] = {}
    for t in tenants:
        if t.token_budget is None:
            continue
        window, ends = window_of(t.token_budget.period, now)
        spent = sum(read_spend(app_name, t.name, window).values())
        report[t.name] = {
            "tokens": t.token_budget.tokens, "period": t.token_budget.period,
            "window": window, "spent": spent, "left": max(0, t.token_budget.tokens - spent),
            "resets_at": datetime.fromtimestamp(ends, timezone.utc).strftime(
                "%Y-%m-%dT%H:%M:%SZ")}
    return report


class BudgetSync:
    """Keeps one router replica's :class:`BudgetBook` in step with the store. Single-threaded
    (the router's event loop); the store calls run in a thread."""

    def __init__(self, book: BudgetBook, app_name: str, replica: str) -> None:
        self.book = book
        self.app_name = app_name
        self.replica = replica
        self._task: asyncio.Task[None] | None = None
        self._round: asyncio.Future[None] | None = None
        self._pruned: dict[int, str] | None = None  # the windows current at the last prune

    async def ready(self, tenant: str) -> None:
        """Return once ``tenant``'s current budget window has been read (at once for a tenant
        without a budget; at most one sync round after a new tenant or window appears). The
        first call starts the background sync."""
        loop = asyncio.get_running_loop()
        if self._task is None and self.book.budgeted():
            self._task = loop.create_task(self._run())
        while not self.book.ready(tenant):
            if self._round is None:
                self._round = loop.create_future()
            await asyncio.shield(self._round)

    async def _run(self) -> None:
        """Sync every SYNC_S for the life of the replica."""
        while True:
            try:
                await self.sync()
            except Exception:  # fail open on what we know; the next round tries again
                logger.warning("token budget store unreachable; enforcing this replica's own "
                               "view of the budgets", exc_info=True)
                self.book.assume_read()
            done, self._round = self._round, None
            if done is not None and not done.done():
                done.set_result(None)
            await asyncio.sleep(SYNC_S)

    async def sync(self) -> None:
        """Write this replica's changed records, then read every budgeted tenant's window;
        at the first sync and after a window ended, delete past windows' records."""
        for (tenant, window), own in self.book.unwritten().items():
            await asyncio.to_thread(write_spend, self.app_name, tenant, window, self.replica,
                                    own)
            self.book.written(tenant, window, own)
        for tenant, window in self.book.windows().items():
            records = await asyncio.to_thread(read_spend, self.app_name, tenant, window)
            own_stored = records.pop(self.replica, 0)
            self.book.merge(tenant, window, sum(records.values()), own_stored)
        windows = current_windows(self.book.clock())
        if windows != self._pruned and self.book.budgeted():
            deleted = await asyncio.to_thread(prune_spend, self.app_name, self.book.clock())
            self._pruned = windows
            if deleted:
                logger.info("deleted %d token budget records of past windows", deleted)
