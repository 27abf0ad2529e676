"""A router replica's concurrency slots, leased from the app's quota actor by demand
(``quota_scope: cluster``): a tenant's ``max_concurrent_requests`` holds for the whole app, not
as 1/N on each of N router replicas.

**The lease protocol.** The actor's :class:`~serve_app.governance.concurrency.SlotTable` owns each
capped tenant's whole cap. A replica (:class:`ClusterSlots`, the slot source of its
:class:`~serve_app.governance.concurrency.ConcurrencyCaps`) runs a tenant's requests while it has
fewer sequences in flight than the slots it holds; that needs no call. It calls the actor
(``lease_slots``: one call for all its tenants, never one per request, at most one in flight):

- at once when a request of a tenant waits and none of its slots is free (it then asks for the
  whole cap; the actor splits the cap max-min fair among the replicas asking), unless the last
  answer already left that tenant short (then at the next round);
- every ``SYNC_S`` while it holds slots or has requests in flight or waiting: the round renews
  its lease and gives back what it did not use since the last round (it asks for the most it
  had in flight meanwhile). The actor counts a replica silent for ``SLOT_TTL_S`` as gone.

So slots held idle by one replica reach a replica whose requests wait within a round or two
(``SYNC_S`` each), and a replica over its share (the split changed) starts nothing until its
requests end below it. While a call is on its way the replica uses at most what it asked for,
so a slot it gives back is never used twice. Total slots in use never exceed the cap, except:
requests weigh their ``n`` (a request may pass the cap by less than its ``n``, as on one
replica), during an outage (below), and for one round after the actor restarted (its table is
rebuilt from the replicas' reports).

**The failure rule** is the cluster quota's (:mod:`serve_app.governance.cluster_quota`), on the
same :class:`~serve_app.governance.quota_link.ActorLink`: a call unanswered within
``CALL_TIMEOUT_S`` begins an outage, and from then each replica runs on its static share of
every cap (1/N, at least one) until a call is answered again (a probe every ``RETRY_S``); the
answer reconciles: the replica reports what it runs, and the actor counts it before granting
anyone more. A replica's first call may wait longer (it may create the actor); after
``CALL_TIMEOUT_S`` without an answer its requests run on the share meanwhile. So no request
waits on the actor for more than about ``CALL_TIMEOUT_S``.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import TYPE_CHECKING

from serve_app.governance import quota_link
from serve_app.governance.quota_link import ActorLink

if TYPE_CHECKING:
    from serve_app.governance.concurrency import ConcurrencyCaps

logger = logging.getLogger(__name__)

SYNC_S = 0.25


class ClusterSlots:
    """One router replica's leased slots (see the module docstring); the
    :class:`~serve_app.governance.concurrency.SlotSource` of its caps. Single-threaded (the
    router's event loop)."""

    def __init__(self, link: ActorLink) -> None:
        self.router_id = uuid.uuid4().hex  # a restarted replica is a new holder
        self._link = link
        link.add_outage_listener(self._fall_back)
        self._caps: ConcurrencyCaps | None = None
        self._limits: dict[str, int] = {}        # the actor's last answer
        self._asking: dict[str, int] | None = None  # slots wanted by the call in flight
        self._blocked: set[str] = set()          # tenants whose requests wait for a slot
        self._short: set[str] = set()            # the last answer gave less than asked
        self._peak: dict[str, int] = {}          # most in flight since the last call
        self._fallback = False                   # the static share: no word from the actor
        self._claims: set[str] = set()           # tenants the actor may count slots of here
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None

    def bind(self, caps: ConcurrencyCaps) -> None:
        self._caps = caps

    @property
    def degraded(self) -> bool:
        """Whether the static shares are in force (an outage, or a slow first answer)."""
        return self._fallback

    # -- the caps' calls (the hot path: no await, no remote call) -------------------------------
    def limit(self, tenant: str) -> int | None:
        if self._fallback:
            return None
        slots = self._limits.get(tenant, 0)
        if self._asking is not None and tenant in self._asking:
            slots = min(slots, self._asking[tenant])  # what it gives back is not used meanwhile
        return slots

    def wanted(self, tenant: str) -> None:
        if tenant in self._blocked:
            return
        self._blocked.add(tenant)
        self._start()
        if tenant not in self._short and self._wake is not None:
            self._wake.set()

    def took(self, tenant: str, held: int) -> None:
        if held > self._peak.get(tenant, 0):
            self._peak[tenant] = held
        self._start()  # renew while in use

    # -- the calls --------------------------------------------------------------------------------
    def _start(self) -> None:
        if self._task is None or self._task.done():
            loop = asyncio.get_running_loop()
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._run())

    def _busy(self) -> bool:
        caps = self._caps
        assert caps is not None
        return bool(self._fallback or self._blocked or self._claims
                    or any(self._limits.values())
                    or any(n for t, n in caps.held.items() if caps.whole(t)))

    async def _run(self) -> None:
        """Sync at once when woken, else every SYNC_S while busy; during an outage, a probe
        every RETRY_S. Ends when there is nothing to hold (started again on demand)."""
        assert self._wake is not None
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), SYNC_S)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            if self._link.outage:
                if self._link.probe_due():
                    await self._sync()
                continue
            if not self._busy():
                return
            await self._sync()

    async def _sync(self) -> None:
        caps = self._caps
        assert caps is not None
        actor = self._link.actor
        if actor is not None and not hasattr(actor, "lease_slots"):
            # Started by an older version (it is detached: it outlives deploys): it has no
            # slots to lease. The static shares, without an outage (its quota still answers).
            if not self._fallback:
                logger.warning("the quota actor predates concurrency slots; enforcing this "
                               "router replica's share of every concurrency cap until it is "
                               "replaced")
            self._fall_back()
            return
        tenants = {t for t in (*self._limits, *self._blocked, *caps.held, *self._claims)
                   if caps.whole(t)}
        report: dict[str, list[int]] = {}
        for t in tenants:
            used = caps.held.get(t, 0)
            want = caps.whole(t) if t in self._blocked else max(used, self._peak.get(t, 0))
            report[t] = [used, want or 0]
        blocked, self._blocked = self._blocked, set()
        self._peak = {t: caps.held[t] for t in tenants if caps.held.get(t)}
        self._asking = {t: want for t, (_, want) in report.items()}
        slow = None
        if not self._link.answered:  # it may be creating the actor: the share meanwhile
            slow = asyncio.get_running_loop().call_later(quota_link.CALL_TIMEOUT_S,
                                                          self._fall_back)
        try:
            answer = await self._link.call("lease_slots", self.router_id, report)
        except Exception:  # an outage: the link told _fall_back
            self._blocked |= blocked  # still waiting: asked again when the actor is back
            return
        finally:
            self._asking = None
            if slow is not None:
                slow.cancel()
        self._limits = {t: n for t, n in answer.items() if n}
        # Until a report of nothing is answered, the actor counts what this replica last
        # might have used: keep syncing, or those slots wait for SLOT_TTL_S.
        self._claims = {t for t, (used, want) in report.items() if used or want}
        self._short = {t for t, n in answer.items() if n is not None and n < report[t][1]}
        self._fallback = False
        caps.changed()

    def _fall_back(self) -> None:
        """An outage began (or the first answer is slow): the static shares, from now until a
        call of this replica is answered."""
        if self._fallback:
            return
        self._fallback = True
        if self._caps is not None:
            self._caps.changed()
        try:
            self._start()  # to probe and reconcile
        except RuntimeError:  # no running loop (not from the router's event loop)
            pass
