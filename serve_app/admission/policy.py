"""The admission-capacity contract: from the engines' live load to how many requests of one
model a router replica may have in flight.

Called by :class:`serve_app.admission.feed.EngineFeed` after every poll of the model's
replicas (many times a second while there is work); the result goes to the model's
:class:`serve_app.admission.controller.AdmissionController`, which releases queued requests
while its in-flight count is below it. Policies are pure functions of the snapshot (no I/O, no Ray),
so they are unit-tested by driving them with scripted loads.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from serve_app.engine.protocol import EngineLoad


class CapacityPolicy(Protocol):
    """Maps the live replicas' loads to this router replica's in-flight limit for the model."""

    def capacity(self, replicas: Sequence[EngineLoad], num_routers: int) -> int:
        """In-flight limit for one router replica; ``replicas`` are the live ones (possibly
        none: the result is then 1, so one request reaches Serve, which starts a replica).
        Called after every poll, in order."""
        ...


COLD_START_PROBE = 1  # requests let through while a model has no live replica (see above)


def share(total: int, num_routers: int, upper_bound: int | None) -> int:
    """One router replica's share of ``total`` (each router holds its own queue), bounded."""
    per_router = -(-total // max(1, num_routers))
    if upper_bound is not None:
        per_router = min(per_router, -(-upper_bound // max(1, num_routers)))
    return max(COLD_START_PROBE, per_router)
