"""Per-tenant caps on work in flight (``max_concurrent_requests``), pure Python (no Ray).

A tenant's TPM is charged when a request ends, so tokens left in its bucket do not stop it from
starting any number of long requests at once; a cap does. The cap counts *sequences*, as
admission does (a request weighs its ``n``), over every model of one router replica. A request
may start while its tenant has fewer sequences in flight than its cap, whatever its weight (as
:meth:`~serve_app.admission.controller.AdmissionController.has_room`: requiring room for the
whole weight would starve a request whose ``n`` is above the cap), so the count may pass the
cap by less than the largest ``n``. Requests beyond it wait in the tenant's queue; a tenant at
its cap cannot hold the fair queue's head (:meth:`serve_app.tenancy.fair_queue.FairQueue.pop`
skips it), so other tenants pass it. Nor can its waiting requests shut its band to the others:
the band's bound refuses only tenants holding their equal share of it, and each tenant's queue
has its own bound (``router.max_queued_per_tenant``; see
:meth:`serve_app.admission.controller.AdmissionController._check_queue_bounds`).

With several router replicas each holds its share of every cap (``share``, 1/replicas), at
least one sequence, as for the other limits.

Single-threaded (the router's event loop): admission controllers call :meth:`take` when they
release a request to an engine and :meth:`give` when it ends; every controller subscribed is
then told to admit again, because a tenant's waiters may sit in another model's queue.
"""

from __future__ import annotations

import math
from typing import Callable

from serve_app.config import TenantSettings


class ConcurrencyCaps:
    """Sequences in flight per tenant, against each tenant's cap (None: no cap)."""

    def __init__(self, tenants: list[TenantSettings], share: float = 1.0) -> None:
        if not 0 < share <= 1:
            raise ValueError("share must be in (0, 1]")
        self.share = share
        self.held: dict[str, int] = {}
        self._caps: dict[str, int] = {}
        self._listeners: list[Callable[[], None]] = []
        self.update(tenants)

    def update(self, tenants: list[TenantSettings]) -> None:
        """Take a new tenant list (a live change); requests in flight stay counted, and a
        raised or removed cap lets waiters start at once."""
        self._caps = {t.name: max(1, math.floor(t.max_concurrent_requests * self.share))
                      for t in tenants if t.max_concurrent_requests}
        self._notify()

    def cap(self, tenant: str) -> int | None:
        """``tenant``'s cap in this router replica, or None."""
        return self._caps.get(tenant)

    def may_start(self, tenant: str) -> bool:
        """Whether a request of ``tenant`` may start now (it is below its cap, or has none)."""
        cap = self._caps.get(tenant)
        return cap is None or self.held.get(tenant, 0) < cap

    def take(self, tenant: str, weight: int) -> None:
        """A request of ``weight`` sequences of ``tenant`` went to an engine."""
        self.held[tenant] = self.held.get(tenant, 0) + weight

    def give(self, tenant: str, weight: int) -> None:
        """That request ended: its sequences no longer count; waiters may start."""
        left = self.held.get(tenant, 0) - weight
        if left > 0:
            self.held[tenant] = left
        else:
            self.held.pop(tenant, None)
        if tenant in self._caps:
            self._notify()

    def subscribe(self, admit: Callable[[], None]) -> None:
        """Call ``admit`` whenever a capped tenant's sequences drop or caps change."""
        self._listeners.append(admit)

    def _notify(self) -> None:
        for admit in self._listeners:
            admit()
