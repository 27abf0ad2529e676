"""Admission to one model's engines: at most ``capacity`` requests in flight from this router
replica; the rest wait in the router, in a :class:`~serve_app.tenancy.fair_queue.FairQueue`.

Holding the queue here rather than in vLLM's waiting queue is what makes priorities and fairness
real: the engines only ever see requests the router chose to release. Below capacity a request
passes straight through (no queue, no extra hop): the benchmarks' hot path is unchanged.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable

from serve_app.config import Priority
from serve_app.tenancy.fair_queue import QUEUE_POLICIES, FairQueue


class QueueFull(Exception):
    """The band's queue is at its bound; the caller answers 429."""


@dataclass(eq=False)
class _Waiter:
    future: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop()
                                         .create_future())


class AdmissionController:
    """In-flight cap and fair queue of one model in one router replica."""

    def __init__(self, capacity: int, max_queued: int,
                 on_change: Callable[[AdmissionController], None] | None = None,
                 policy: str = "fair") -> None:
        """``on_change`` is called whenever the queue grows or shrinks (metrics); ``policy``
        names the queue order (:data:`~serve_app.tenancy.fair_queue.QUEUE_POLICIES`)."""
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self.max_queued = max_queued
        self.in_flight = 0
        self.queue: FairQueue[_Waiter] = QUEUE_POLICIES[policy]()
        self._on_change = on_change or (lambda _: None)

    def queued(self, band: Priority | None = None) -> int:
        return self.queue.waiting(band)

    async def acquire(self, tenant: str, band: Priority) -> None:
        """Return once the request may go to an engine; the caller must :meth:`release` then.
        Raises :class:`QueueFull` when ``band`` already holds ``max_queued`` waiting requests.
        Cancellation while waiting (client gone) leaves nothing behind."""
        if self.in_flight < self.capacity and not len(self.queue):
            self.in_flight += 1
            return
        if self.queue.waiting(band) >= self.max_queued:
            raise QueueFull(band)
        waiter = _Waiter()
        self.queue.push(waiter, tenant, band)
        self._on_change(self)
        try:
            await waiter.future
        except asyncio.CancelledError:
            if self.queue.remove(waiter):
                self._on_change(self)
            elif waiter.future.done() and not waiter.future.cancelled():
                self.release(tenant, 0)  # admitted as we were cancelled: give the slot back
            raise

    def release(self, tenant: str, service: float) -> None:
        """One admitted request ended; charge its tenant and admit the next waiters."""
        self.in_flight -= 1
        self.queue.charge(tenant, service)
        admitted = False
        while self.in_flight < self.capacity:
            waiter = self.queue.pop()
            if waiter is None:
                break
            admitted = True
            if waiter.future.done():  # cancelled before we got to it
                continue
            waiter.future.set_result(None)
            self.in_flight += 1
        if admitted:
            self._on_change(self)


class Slot:
    """A request's hold on an admission slot; :meth:`release` is safe to call on every exit
    path (it releases once, and only what was acquired)."""

    __slots__ = ("_controller", "_tenant")

    def __init__(self) -> None:
        self._controller: AdmissionController | None = None
        self._tenant = ""

    async def acquire(self, controller: AdmissionController, tenant: str, band: Priority) -> None:
        await controller.acquire(tenant, band)
        self._controller, self._tenant = controller, tenant

    def release(self, service: float) -> None:
        controller, self._controller = self._controller, None
        if controller is not None:
            controller.release(self._tenant, service)


__all__ = ["AdmissionController", "QueueFull", "Slot"]
