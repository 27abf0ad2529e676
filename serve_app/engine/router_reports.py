"""What the router replicas told one engine replica about their demand for its model.

Every router's load poll reports how many requests of the model it holds queued and has in
flight (:meth:`serve_app.engine.server.LLMServer.engine_load`). The replica keeps the latest
report of each router and hands them on:

- to the routers, as every router's demand (:attr:`EngineLoad.router_demand`), by which they
  share the model's capacity (:mod:`serve_app.admission.share`). A report stops counting here
  after ``DEMAND_REPORT_TTL_S``: a router that holds anything polls every ``poll_interval_s``
  (20 ms), so a report that old comes from a router that is gone (crashed, restarted under a
  new id) or stuck, and a dead router's demand must not keep its share: with a 3 s TTL the
  live routers admitted only what the stale report left, the engines' running count stopped
  growing, and the engine-feedback capacity stayed trapped low until the TTL (bench/RESULTS.md
  27, finding 1). A router whose output channel to this replica closes is forgotten at once.
- to the autoscaler, as the model's backlog in the routers (queued requests), for
  ``BACKLOG_REPORT_TTL_S``: it decides on seconds, and an idle router reports only every idle
  poll interval.

Plain bookkeeping on the replica's event loop (no I/O); the simulation uses the same class.
"""

from __future__ import annotations

import time
from typing import Callable

# An idle router reports every idle_poll_interval_s (0.5 s by default): a backlog report
# lives a few of those.
BACKLOG_REPORT_TTL_S = 3.0
# A busy router reports every poll_interval_s (20 ms by default) plus the poll's round trip,
# which one slow replica can stretch to the answer deadline (serve_app.admission.feed): a
# demand report lives a couple of those, and a router with no demand loses nothing by it.
DEMAND_REPORT_TTL_S = 0.75


class RouterReports:
    """The latest report of each router replica, with the time it arrived."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 demand_ttl_s: float = DEMAND_REPORT_TTL_S) -> None:
        self._clock = clock
        self.demand_ttl_s = demand_ttl_s
        # router id -> (requests it holds queued, requests it has in flight, when it said so)
        self._reports: dict[str, tuple[int, int, float]] = {}

    def record(self, router_id: str, queued: int, in_flight: int) -> None:
        """``router_id`` holds ``queued`` requests of the model and has ``in_flight`` out."""
        self._reports[router_id] = (queued, in_flight, self._clock())

    def forget(self, router_id: str) -> None:
        """``router_id`` is gone (its output channel closed): its demand counts no more."""
        self._reports.pop(router_id, None)

    def demand(self) -> tuple[tuple[str, int], ...]:
        """Each router's demand (queued + in flight) as of its report, for reports younger than
        ``demand_ttl_s``."""
        now = self._clock()
        self._expire(now)
        return tuple((rid, queued + in_flight) for rid, (queued, in_flight, t)
                     in self._reports.items() if now - t <= self.demand_ttl_s)

    def backlog(self) -> int:
        """Requests the routers hold queued, from reports younger than
        ``BACKLOG_REPORT_TTL_S``."""
        self._expire(self._clock())
        return sum(queued for queued, _, _ in self._reports.values())

    def _expire(self, now: float) -> None:
        for rid in [r for r, (*_, t) in self._reports.items() if now - t > BACKLOG_REPORT_TTL_S]:
            del self._reports[rid]


__all__ = ["BACKLOG_REPORT_TTL_S", "DEMAND_REPORT_TTL_S", "RouterReports"]
