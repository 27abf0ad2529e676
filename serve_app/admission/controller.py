"""Admission to one model's engines: at most ``capacity`` sequences in flight from this router
replica; the rest wait in the router, in a :class:`~serve_app.governance.fair_queue.FairQueue`.

A request weighs its ``n``: vLLM runs one sequence per choice, each taking a place in the
engine's batch, and the engines' load that sets ``capacity`` counts sequences. Counting a
16-choice request as one place let a tenant hold 16 engine places per admission place (seen in
``make chaos``: 4 such requests filled two 4-sequence engines, bench/RESULTS.md 9d).

Holding the queue here rather than in vLLM's waiting queue is what makes priorities and fairness
real: the engines only ever see requests the router chose to release. ``capacity`` is not a
constant: :class:`serve_app.admission.feed.EngineFeed` sets it from the engines' live load
many times a second (:mod:`serve_app.admission`), so it follows what the engines start and how many
replicas exist. Below capacity a request passes straight through (no queue, no extra hop).

Waiting is bounded per band and per tenant (:meth:`AdmissionController._check_queue_bounds`):
a tenant's backlog, e.g. one held back by its concurrency cap, cannot shut its band to others.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Collection, Literal

from serve_app.config import Priority, RouterSettings
from serve_app.governance.concurrency import ConcurrencyCaps
from serve_app.governance.fair_queue import BANDS, QUEUE_POLICIES, FairQueue, engine_priority


class QueueFull(Exception):
    """The request may not wait: its band's queue is full (``reason`` ``"band"``) or its tenant
    already holds ``max_queued_per_tenant`` waiting requests (``"tenant"``, ``waiting`` of them).
    The caller answers 429; ``str()`` is the message's tail after the model's name."""

    def __init__(self, band: Priority, reason: Literal["band", "tenant"] = "band",
                 waiting: int = 0) -> None:
        super().__init__(band, reason, waiting)
        self.band, self.reason, self.waiting = band, reason, waiting

    def __str__(self) -> str:
        if self.reason == "tenant":
            return (f"has {self.waiting} of your requests waiting already, the most one tenant "
                    "may queue for it; retry once some have finished")
        return f"is at capacity and the {self.band}-priority queue is full; retry shortly"


_PER_TENANT_DEFAULT: int = RouterSettings.model_fields["max_queued_per_tenant"].default


class NoReplicaInTime(Exception):
    """The request waited ``cold_start_timeout_s`` while its model had no live replica, or
    ``reason`` says why its model's replica cannot be placed at all."""

    def __init__(self, reason: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(eq=False)
class _Waiter:
    tenant: str
    band: Priority
    weight: int = 1
    prepaid: float = 0.0
    future: asyncio.Future[int] = field(default_factory=lambda: asyncio.get_running_loop()
                                        .create_future())
    since: float = field(default_factory=time.monotonic)


class AdmissionController:
    """In-flight limit and fair queue of one model in one router replica. ``in_flight`` and
    ``capacity`` count sequences (a request weighs its ``n``); ``tenant_in_flight`` counts
    requests.

    Only work on the replicas in the engine feed's latest view counts against ``capacity``
    (:attr:`counted`): a request is counted from its admission, and once its first chunk names
    its replica (:meth:`assign`) it stops counting while that replica is out of the view
    (draining, dead, or not answering), because the capacity no longer includes that replica
    either. Otherwise every scale-down and rolling update froze admission behind the old
    replicas' streams (200 streams draining beside an idle new replica: 0 of 100 queued
    requests admitted in 1 s).

    Single-threaded (the router's event loop): ``acquire`` by request handlers, ``assign`` once
    a request's replica is known, ``release`` when a request ends, ``set_capacity`` and
    ``expire_waiting`` by the model's engine feed."""

    def __init__(self, capacity: int, max_queued: int,
                 on_change: Callable[[AdmissionController], None] | None = None,
                 policy: str = "fair", first_request_slots: int = 0,
                 caps: ConcurrencyCaps | None = None,
                 max_queued_per_tenant: int = _PER_TENANT_DEFAULT) -> None:
        """``on_change`` is called whenever the queue grows or shrinks (metrics); ``policy``
        names the queue order (:data:`~serve_app.governance.fair_queue.QUEUE_POLICIES`).
        ``max_queued`` and ``max_queued_per_tenant`` bound the waiting requests per band and
        per tenant (:meth:`acquire`).

        ``first_request_slots``: a tenant with nothing in flight gets its request in at once,
        even at capacity, as long as no higher band waits and fewer than this many such
        requests are out. Its engine priority then puts it first in the engine's own queue, so
        a quiet tenant's request starts at the engine's next step instead of after the next
        completion plus a poll (fair policy only). The bound counts these requests themselves,
        not the distance to capacity: capacity follows the engines, which drop a finished batch
        before the router has sent its responses, and a quiet request refused then waited a
        whole generation (seen on an H200: 8.5 s for one of ten).

        ``caps``: per-tenant concurrency caps shared by the router replica's models
        (:mod:`serve_app.governance.concurrency`); a tenant at its cap waits, and the queue passes
        it over for the others."""
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self.max_queued = max_queued
        self.max_queued_per_tenant = max_queued_per_tenant
        self.in_flight = 0
        self.tenant_in_flight: dict[str, int] = {}
        # Sequences per replica that serves them; the live replicas (None: no view yet, so
        # everything counts); sequences on replicas outside the view.
        self.on_replica: Counter[str] = Counter()
        self.live: frozenset[str] | None = None
        self.off_view = 0
        # Tenants holding a first-request slot; each frees it at its next release.
        self.overdraft: set[str] = set()
        self.queue: FairQueue[_Waiter] = QUEUE_POLICIES[policy]()
        # The FIFO baseline stays FIFO inside the engine too (every request priority 0).
        self._prioritize = policy == "fair"
        self.first_request_slots = first_request_slots if self._prioritize else 0
        self._on_change = on_change or (lambda _: None)
        # Set while requests wait for a slot: the engine feed polls at once instead of on its
        # timer, so capacity catches up with a burst within one engine step.
        self.blocked = asyncio.Event()
        self.caps = caps
        if caps is not None:  # a capped tenant's request ending elsewhere may free our waiters
            caps.subscribe(self._admit)

    def queued(self, band: Priority | None = None) -> int:
        return self.queue.waiting(band)

    def has_room(self) -> bool:
        """Whether a request may start now: while fewer than ``capacity`` sequences are out,
        whatever its weight, so in-flight may pass the capacity
        by less than the largest ``n`` (16 by default). Requiring room for the whole weight
        starved large requests: smaller ones kept the count above ``capacity - n`` (seen in
        ``make chaos``: a 16-choice request waited minutes behind another tenant's streams)."""
        return self.counted < self.capacity

    @property
    def counted(self) -> int:
        """Sequences in flight that count against ``capacity``: all but those on replicas
        outside the latest view."""
        return self.in_flight - self.off_view

    def assign(self, replica: str, weight: int = 1) -> None:
        """An admitted request of ``weight`` sequences runs on ``replica`` (its first chunk said
        so); :meth:`release` must then name the replica."""
        self.on_replica[replica] += weight
        if self.live is not None and replica not in self.live:
            self.off_view += weight

    async def acquire(self, tenant: str, band: Priority, weight: int = 1,
                      prepaid: float = 0.0) -> int:
        """Return once the request (``weight``: its sequences, the request's ``n``) may go to
        an engine, with its engine priority (see
        :func:`~serve_app.governance.fair_queue.engine_priority`); the caller must
        :meth:`release` it with the same weight then, and the service still owed (negative:
        what ``prepaid`` overestimated).

        ``prepaid``: the fair-share service the request is expected to cost (its prompt and
        most output, :func:`~serve_app.governance.fair_queue.service_of`), charged to its tenant
        at the moment it is granted, before the queue chooses the next one. Charged only as
        tokens came, every place freed at once (a batch of long generations ending together)
        went to the tenant least served at that instant, which then held the engine for a
        whole generation: two backlogged tenants took turns owning it (issue 37, finding 2).
        Raises :class:`QueueFull` when the request would have to wait beyond a bound
        (:meth:`_check_queue_bounds`), :class:`NoReplicaInTime` from :meth:`expire_waiting`.
        Cancellation while waiting (client gone) leaves nothing behind."""
        capped = self.caps is not None and not self.caps.may_start(tenant)
        if self.has_room() and not len(self.queue) and not capped:
            return self._grant_unqueued(tenant, band, weight, prepaid)
        if (not capped and not self.tenant_in_flight.get(tenant)
                and len(self.overdraft) < self.first_request_slots
                and not any(self.queue.waiting(b) for b in BANDS[:BANDS.index(band)])):
            self.overdraft.add(tenant)
            return self._grant_unqueued(tenant, band, weight, prepaid)
        self._check_queue_bounds(tenant, band)
        waiter = _Waiter(tenant, band, weight, prepaid)
        self.queue.push(waiter, tenant, band)
        self.blocked.set()
        self._on_change(self)
        if self.has_room():  # the queue held only capped tenants: this one may go at once
            self._admit()
        try:
            return await waiter.future
        except asyncio.CancelledError:
            if self.queue.remove(waiter):
                if not len(self.queue):
                    self.blocked.clear()
                self._on_change(self)
            elif waiter.future.done() and not waiter.future.cancelled() \
                    and waiter.future.exception() is None:
                # Admitted as we were cancelled: give the place and the prepaid service back.
                self.release(tenant, -prepaid, weight)
            raise

    def _check_queue_bounds(self, tenant: str, band: Priority) -> None:
        """Raise :class:`QueueFull` if a request of ``tenant`` may not wait in ``band``.

        A tenant holding ``max_queued_per_tenant`` waiting requests (over all bands) is refused.
        A band holding ``max_queued`` refuses only a tenant that holds at least its equal share
        of the band's waiting requests (their number over the tenants waiting there, this one
        included): the tenants with the most waiting are refused, never one below the average,
        and a newcomer always gets in. Before, the band's bound refused everyone, so a tenant
        held back by its ``max_concurrent_requests`` (its requests wait however idle the engines
        are) filled the band and every other tenant of the band got 429 (issue 37: 110 requests
        of a tenant capped at 2). A tenant alone still stops at ``max_queued`` (its share is the
        whole band), and ``max_queued`` 0 still means no waiting at all. Memory stays bounded:
        the band grows past ``max_queued`` only while tenants below the average catch up, never
        past ``max_queued_per_tenant`` per waiting tenant."""
        mine = self.queue.waiting(tenant=tenant)
        if mine >= self.max_queued_per_tenant:
            raise QueueFull(band, "tenant", mine)
        in_band = self.queue.waiting(band)
        if in_band >= self.max_queued:
            mine_here = self.queue.waiting(band, tenant)
            tenants = self.queue.tenants_waiting(band) + (0 if mine_here else 1)
            if mine_here * tenants >= in_band:
                raise QueueFull(band)

    def _grant_unqueued(self, tenant: str, band: Priority, weight: int,
                        prepaid: float) -> int:
        """Grant a request that never waited: it moves the band's virtual clock like a pop."""
        self.queue.served(tenant, band, newly_active=not self.tenant_in_flight.get(tenant))
        return self._grant(tenant, band, weight, prepaid)

    def _grant(self, tenant: str, band: Priority, weight: int, prepaid: float) -> int:
        """Count a released request and charge its prepaid service; its engine priority
        reflects what its tenant had out."""
        if prepaid:
            self.queue.charge(tenant, prepaid)
        held = self.tenant_in_flight.get(tenant, 0)
        self.tenant_in_flight[tenant] = held + 1
        self.in_flight += weight
        if self.caps is not None:
            self.caps.take(tenant, weight)
        return engine_priority(band, held) if self._prioritize else 0

    def release(self, tenant: str, service: float, weight: int = 1,
                replica: str | None = None) -> None:
        """One admitted request of ``weight`` sequences ended (on ``replica``, if it was
        assigned one); charge its tenant and admit the next waiters."""
        self.in_flight -= weight
        if replica is not None:
            left = self.on_replica[replica] - weight
            if left > 0:
                self.on_replica[replica] = left
            else:
                del self.on_replica[replica]
            if self.live is not None and replica not in self.live:
                self.off_view -= weight
        self.overdraft.discard(tenant)
        held = self.tenant_in_flight.get(tenant, 1) - 1
        if held > 0:
            self.tenant_in_flight[tenant] = held
        else:
            self.tenant_in_flight.pop(tenant, None)
        self.queue.charge(tenant, service)
        if self.caps is not None:
            self.caps.give(tenant, weight)  # admits here and in the other models' queues
        self._admit()

    def set_capacity(self, capacity: int, live: Collection[str] | None = None) -> None:
        """The engines' live capacity changed (at least 1), and with ``live`` the replicas in
        the view it was computed from; admit waiters if there is room."""
        self.capacity = max(1, capacity)
        if live is not None:
            self.live = frozenset(live)
            self.off_view = sum(w for r, w in self.on_replica.items() if r not in self.live)
        self._admit()

    def expire_waiting(self, older_than_s: float, reason: str | None = None) -> int:
        """Fail requests that have waited longer than ``older_than_s`` (their model has no live
        replica; ``reason``: why it cannot have one); returns how many."""
        now = time.monotonic()
        expired = 0
        while True:
            waiter = self.queue.pop_where(lambda w: now - w.since > older_than_s)
            if waiter is None:
                break
            if not waiter.future.done():
                waiter.future.set_exception(NoReplicaInTime(reason))
                expired += 1
        if not len(self.queue):
            self.blocked.clear()
        if expired:
            self._on_change(self)
        return expired

    def _admit(self) -> None:
        """Admit waiters in the queue's order while sequences are below the capacity."""
        admitted = False
        eligible = self.caps.may_start if self.caps is not None else None
        while self.has_room() and (waiter := self.queue.pop(eligible)) is not None:
            admitted = True
            if waiter.future.done():  # cancelled before we got to it
                continue
            waiter.future.set_result(self._grant(waiter.tenant, waiter.band, waiter.weight,
                                                 waiter.prepaid))
        if not len(self.queue):
            self.blocked.clear()
        if admitted:
            self._on_change(self)


class Slot:
    """A request's hold on an admission slot; :meth:`release` is safe to call on every exit
    path (it releases once, and only what was acquired)."""

    __slots__ = ("_controller", "_tenant", "_weight", "_replica", "priority")

    def __init__(self) -> None:
        self._controller: AdmissionController | None = None
        self._tenant = ""
        self._weight = 1
        self._replica: str | None = None
        self.priority = 0

    async def acquire(self, controller: AdmissionController, tenant: str, band: Priority,
                      weight: int = 1, prepaid: float = 0.0) -> None:
        """Wait for a place (:meth:`AdmissionController.acquire`, ``prepaid`` charged when it
        is granted)."""
        self.priority = await controller.acquire(tenant, band, weight, prepaid)
        self._controller, self._tenant, self._weight = controller, tenant, weight

    def assign(self, replica: str | None) -> None:
        """The request runs on ``replica`` (once; ignored without a replica or a hold)."""
        if replica is None or self._controller is None or self._replica is not None:
            return
        self._replica = replica
        self._controller.assign(replica, self._weight)

    def release(self, service: float) -> None:
        controller, self._controller = self._controller, None
        if controller is not None:
            controller.release(self._tenant, service, self._weight, self._replica)


__all__ = ["AdmissionController", "NoReplicaInTime", "QueueFull", "Slot"]
