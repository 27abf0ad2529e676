"""A router replica's calls to the app's quota actor, under the one failure rule of the
cluster quota (stated in :mod:`serve_app.governance.cluster_quota`).

:class:`ActorLink` sends a call and waits ``CALL_TIMEOUT_S`` at most (``STARTUP_TIMEOUT_S``
until the actor first answered this replica: that call may create the actor, whose worker
takes seconds to start on a loaded host). A call that fails or gets no answer in time begins an
*outage*: every other call in flight is given up at once (its caller does not wait for its own
time-out), the owner's ``on_outage`` (and every listener added with
:meth:`ActorLink.add_outage_listener`: the link is shared by the replica's rate quota and its
concurrency slots) runs once, the ``serve_app_quota_degraded`` gauge goes to
1, and :attr:`ActorLink.outage` stays true until a call is answered again. Calls are not
refused during an outage; the owner decides what to send (a probe every ``RETRY_S``, see
:meth:`ActorLink.probe_due`). Giving up a call does not cancel it on the actor (Ray cannot):
it may still run there later.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from serve_app.observability.metrics import METRICS, ROUTER_METRICS, exported_name

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 1.0
# A replica's first call waits longer: it may create the actor, whose worker process takes
# seconds to start on a loaded host (with 1 s every router fell back to its share at start).
STARTUP_TIMEOUT_S = 30.0
RETRY_S = 5.0


class QuotaUnavailable(Exception):
    """The actor did not answer in time, or failed: this replica is in an outage."""


def _degraded_gauge() -> Any:
    """The ``serve_app_quota_degraded`` gauge (name and help from the metric table)."""
    from ray.serve.metrics import Gauge

    name = ROUTER_METRICS["quota_degraded"]
    return Gauge(name, description=METRICS[exported_name(name, "gauge")].help)


class ActorLink:
    """Calls to one actor with time-outs and outages (see the module docstring). ``get_actor``
    returns a handle (run in a thread: it may create the actor); ``routers`` is for the log.
    Single-threaded (the router's event loop)."""

    def __init__(self, get_actor: Callable[[], Any], on_outage: Callable[[], None],
                 routers: int) -> None:
        self.actor: Any = None
        self.in_flight = 0  # calls sent and not answered, failed or given up yet
        self._get_actor = get_actor
        self._on_outage = [on_outage]
        self._routers = routers
        self._answered = False  # the actor answered this replica at least once
        self._outage = False
        self._outage_began = asyncio.Event()  # set when one begins: releases calls in flight
        self._retry_at = 0.0
        self._gauge: Any = None

    def add_outage_listener(self, on_outage: Callable[[], None]) -> None:
        """Call ``on_outage`` too when an outage begins."""
        self._on_outage.append(on_outage)

    @property
    def answered(self) -> bool:
        """Whether the actor answered this replica at least once."""
        return self._answered

    @property
    def outage(self) -> bool:
        """Whether the last call was not answered in time (and none was answered since)."""
        return self._outage

    def probe_due(self) -> bool:
        """During an outage, true once per RETRY_S (the caller then sends one probe)."""
        if not self._outage or time.monotonic() < self._retry_at:
            return False
        self._retry_at = time.monotonic() + RETRY_S
        return True

    async def call(self, method: str, *args: Any) -> Any:
        """``method`` on the actor within the time-out. No answer in time, or an error, begins
        an outage (if none is on) and raises :class:`QuotaUnavailable`; so does an outage that
        another call began while this one waited. An answer ends an outage."""
        began = self._outage_began
        self.in_flight += 1
        call = asyncio.ensure_future(self._send(method, args))
        stop = asyncio.ensure_future(began.wait())
        try:
            done, _ = await asyncio.wait(
                {call, stop}, timeout=CALL_TIMEOUT_S if self._answered else STARTUP_TIMEOUT_S,
                return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.in_flight -= 1
            stop.cancel()
            if not call.done():
                call.cancel()  # stops the wait only: Ray does not cancel the actor's task
        if call in done and not call.cancelled() and call.exception() is None:
            self._back()
            return call.result()
        error = call.exception() if call in done and not call.cancelled() else None
        if error is None and not began.is_set():
            error = TimeoutError(f"no answer to {method} within the time-out")
        self._down(error)
        raise QuotaUnavailable(f"the cluster quota state did not answer {method}") from error

    async def _send(self, method: str, args: tuple[Any, ...]) -> Any:
        if self.actor is None:
            self.actor = await asyncio.to_thread(self._get_actor)
        return await getattr(self.actor, method).remote(*args)

    def _down(self, error: BaseException | None) -> None:
        """A call failed: begin an outage unless one is on."""
        self.actor = None  # the next call looks the actor up again (or starts a new one)
        self._retry_at = time.monotonic() + RETRY_S
        if self._outage:
            return
        logger.warning("the cluster quota state did not answer; enforcing this router "
                       "replica's share (1/%d) of every limit until it answers (tried again "
                       "every %g s)", self._routers, RETRY_S, exc_info=error)
        self._outage = True
        for on_outage in self._on_outage:
            on_outage()
        self._outage_began.set()
        self._outage_began = asyncio.Event()  # for the calls of the next outage
        self._set_gauge(1)

    def _back(self) -> None:
        """The actor answered: an outage, if one was on, ends."""
        first = not self._answered
        self._answered = True
        if self._outage:
            logger.warning("the cluster quota state answers again; leases resume")
            self._outage = False
            self._set_gauge(0)
        elif first:
            self._set_gauge(0)

    def publish_gauge(self) -> None:
        """Set the gauge to the outage state now (the router's first request: a series that
        appears only with an outage leaves its alert without data, and a gauge set in the
        replica's constructor never reaches Prometheus)."""
        self._set_gauge(1 if self._outage else 0)

    def _set_gauge(self, value: int) -> None:
        try:
            if self._gauge is None:
                self._gauge = _degraded_gauge()
            self._gauge.set(value)
        except Exception:  # a metric never breaks admission
            logger.exception("serve_app_quota_degraded not recorded")
