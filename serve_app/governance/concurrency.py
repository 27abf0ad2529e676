"""Per-tenant caps on work in flight (``max_concurrent_requests``), pure Python (no Ray).

A tenant's TPM is charged as its tokens flow and reserves nothing, so tokens left in its bucket
do not stop it from starting any number of long requests at once; a cap does. The cap counts
*sequences*, as admission does (a request weighs its ``n``), over every model of one router
replica. A request may start while its tenant has fewer sequences in flight than its cap,
whatever its weight (as :meth:`~serve_app.admission.controller.AdmissionController.has_room`:
requiring room for the
whole weight would starve a request whose ``n`` is above the cap), so the count may pass the
cap by less than the largest ``n``. Requests beyond it wait in the tenant's queue; a tenant at
its cap cannot hold the fair queue's head (:meth:`serve_app.governance.fair_queue.FairQueue.pop`
skips it), so other tenants pass it. Nor can its waiting requests shut its band to the others:
the band's bound refuses only tenants holding their equal share of it, and each tenant's queue
has its own bound (``router.max_queued_per_tenant``; see
:meth:`serve_app.admission.controller.AdmissionController._check_queue_bounds`).

**Several router replicas.** With a :class:`SlotSource` (``quota_scope: cluster``: the app's
quota actor, :mod:`serve_app.governance.cluster_slots`) the cap is the tenant's whole cap for the
app: each replica may run as many sequences as it holds *slots* leased from the actor's
:class:`SlotTable`, which never leases more than the cap in all, and leases by demand (a replica
whose requests wait asks; one whose slots idle gives them back). While the source has no word
(an outage), and without a source (``quota_scope: replica``), each replica holds a static share
(``share``, 1/replicas) of every cap, at least one sequence, as for the other limits.

Single-threaded (the router's event loop): admission controllers call :meth:`take` when they
release a request to an engine and :meth:`give` when it ends; every controller subscribed is
then told to admit again, because a tenant's waiters may sit in another model's queue.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from serve_app.config import TenantSettings

# A replica that has not renewed its slots for this long is taken for gone: they are free.
SLOT_TTL_S = 3.0


class SlotSource(Protocol):
    """Where a replica's slots come from (:class:`~serve_app.governance.cluster_slots.ClusterSlots`).
    Called by :class:`ConcurrencyCaps` on the router's event loop, never awaited."""

    def bind(self, caps: ConcurrencyCaps) -> None:
        """The caps it serves: it reads :attr:`ConcurrencyCaps.held` and calls
        :meth:`ConcurrencyCaps.changed` when its slots change."""

    def limit(self, tenant: str) -> int | None:
        """Sequences of ``tenant`` this replica may have in flight now (its slots), or None:
        no word from the actor, use the static share."""

    def wanted(self, tenant: str) -> None:
        """A request of ``tenant`` waits here and none of its slots is free."""

    def took(self, tenant: str, held: int) -> None:
        """``tenant`` now has ``held`` sequences in flight here (after a start)."""


class ConcurrencyCaps:
    """Sequences in flight per tenant, against each tenant's cap (None: no cap)."""

    def __init__(self, tenants: list[TenantSettings], share: float = 1.0,
                 slots: SlotSource | None = None) -> None:
        if not 0 < share <= 1:
            raise ValueError("share must be in (0, 1]")
        self.share = share
        self.held: dict[str, int] = {}
        self._whole: dict[str, int] = {}
        self._caps: dict[str, int] = {}
        self._listeners: list[Callable[[], None]] = []
        self.slots = slots
        if slots is not None:
            slots.bind(self)
        self.update(tenants)

    def update(self, tenants: list[TenantSettings]) -> None:
        """Take a new tenant list (a live change); requests in flight stay counted, and a
        raised or removed cap lets waiters start at once."""
        self._whole = {t.name: t.max_concurrent_requests for t in tenants
                       if t.max_concurrent_requests}
        self._caps = {name: max(1, math.floor(cap * self.share))
                      for name, cap in self._whole.items()}
        self._notify()

    def whole(self, tenant: str) -> int | None:
        """``tenant``'s cap for the whole app, or None."""
        return self._whole.get(tenant)

    def cap(self, tenant: str) -> int | None:
        """``tenant``'s cap in this router replica now (its leased slots, else its share),
        or None."""
        share = self._caps.get(tenant)
        if share is None or self.slots is None:
            return share
        leased = self.slots.limit(tenant)
        return share if leased is None else min(leased, self._whole[tenant])

    def may_start(self, tenant: str) -> bool:
        """Whether a request of ``tenant`` may start now (it is below its cap, or has none).
        No: the slot source is told the tenant wants more (it asks the actor, off this path)."""
        cap = self.cap(tenant)
        if cap is None or self.held.get(tenant, 0) < cap:
            return True
        if self.slots is not None:
            self.slots.wanted(tenant)
        return False

    def take(self, tenant: str, weight: int) -> None:
        """A request of ``weight`` sequences of ``tenant`` went to an engine."""
        held = self.held[tenant] = self.held.get(tenant, 0) + weight
        if self.slots is not None and tenant in self._caps:
            self.slots.took(tenant, held)

    def give(self, tenant: str, weight: int) -> None:
        """That request ended: its sequences no longer count; waiters may start."""
        left = self.held.get(tenant, 0) - weight
        if left > 0:
            self.held[tenant] = left
        else:
            self.held.pop(tenant, None)
        if tenant in self._caps:
            self._notify()

    def changed(self) -> None:
        """The slot source's limits changed: admit again where waiters may start now."""
        self._notify()

    def subscribe(self, admit: Callable[[], None]) -> None:
        """Call ``admit`` whenever a capped tenant's sequences drop or caps change."""
        self._listeners.append(admit)

    def _notify(self) -> None:
        for admit in self._listeners:
            admit()


@dataclass
class _Holder:
    """One router replica's slots of one tenant, as the actor knows them."""

    limit: int = 0        # what the replica was last told it may have in flight
    held: int = 0         # what it may have in flight now, as far as the actor can know
    desired: int = 0      # what it asked for last
    renewed: float = 0.0
    granted: float = 0.0  # when its limit last grew (or it came): the odd slots' order


class SlotTable:
    """The app's concurrency slots, held by the quota actor
    (:class:`~serve_app.governance.quota_state.QuotaState`): each capped tenant's whole cap,
    leased to router replicas by demand. A replica calls :meth:`sync` with, per tenant, the
    sequences it has in flight and the slots it wants (all of the cap while its requests wait,
    else what it used lately); the answer is the slots it may use from then on.

    **Never over the cap.** The slots granted to a replica come out of what the others may be
    using (``held``): its last limit while a call was on its way (it can only have started up
    to that), its reported use, or its new limit, whichever is largest; so ``held`` summed over
    replicas stays at most the cap. A replica over its new limit starts nothing until it is
    below it (running requests are never revoked), so a change of shares takes effect as
    requests end. **By demand.** When replicas want more than the cap, it is split max-min fair
    among them (those left short, then those granted a slot longest ago, get the odd slots),
    so slots rotate between
    replicas whose requests all wait; slots a replica stops using go back at its next sync.
    A replica silent for ``SLOT_TTL_S`` is taken for gone: its slots are free. The table is not
    checkpointed: after an actor restart it is rebuilt from the replicas' reported use as they
    sync (one round), during which a replica may be granted slots another still uses."""

    def __init__(self, tenants: list[TenantSettings],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.caps: dict[str, int] = {}
        self._holders: dict[str, dict[str, _Holder]] = {}
        self.update(tenants)

    def update(self, tenants: list[TenantSettings]) -> None:
        """The live tenant list: caps from now on (a lowered cap is reached as requests end)."""
        self.caps = {t.name: t.max_concurrent_requests for t in tenants
                     if t.max_concurrent_requests}

    def leased(self, tenant: str) -> int:
        """Slots of ``tenant`` the replicas may be using, in all."""
        return sum(h.held for h in self._holders.get(tenant, {}).values())

    def sync(self, router: str, report: dict[str, list[int]]) -> dict[str, int | None]:
        """``report``: tenant -> [sequences in flight, slots wanted] of replica ``router``.
        Returns tenant -> the slots it may use now (None: the tenant has no cap now)."""
        now = self.clock()
        out: dict[str, int | None] = {}
        for tenant, (used, desired) in report.items():
            cap = self.caps.get(tenant)
            holders = self._holders.setdefault(tenant, {})
            for name, h in list(holders.items()):
                if name != router and now - h.renewed > SLOT_TTL_S:
                    del holders[name]  # gone: its slots are free
            if cap is None:
                holders.pop(router, None)
                out[tenant] = None
                continue
            me = holders.get(router) or holders.setdefault(router, _Holder(granted=now))
            # Until it hears this answer the replica may start up to its last limit (at most
            # what it asked for now): that much stays counted whatever the answer.
            bound = max(used, min(me.limit, desired))
            me.desired, me.renewed = min(desired, cap), now
            target = _fair(cap, holders)[router]
            others = sum(h.held for name, h in holders.items() if name != router)
            limit = max(0, min(target, cap - others))
            if limit > me.limit:
                me.granted = now
            me.limit = limit
            me.held = max(me.limit, bound)
            if me.held == 0 and me.desired == 0:
                del holders[router]
            out[tenant] = me.limit
        return out


def _fair(cap: int, holders: dict[str, _Holder]) -> dict[str, int]:
    """Split ``cap`` max-min fair over the holders' wishes, one slot at a time: those left
    short first, then the one granted a slot longest ago (so slots rotate among replicas whose
    requests all wait)."""
    targets = {name: 0 for name in holders}
    order = sorted((h.limit >= h.desired, h.granted, name) for name, h in holders.items()
                   if h.desired > 0)
    active = [name for *_, name in order]
    left = cap
    while left > 0 and active:
        for name in list(active):
            if left == 0:
                break
            targets[name] += 1
            left -= 1
            if targets[name] >= holders[name].desired:
                active.remove(name)
    return targets
