"""The admission-capacity contract: from the engines' live load to how many requests of one
model its routers may have in flight.

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
    """Maps the live replicas' loads to the model's in-flight limit (for all its routers
    together; :mod:`serve_app.admission.share` splits it between them)."""

    def capacity(self, replicas: Sequence[EngineLoad]) -> int:
        """The model's in-flight limit; ``replicas`` are the live ones (possibly none: the
        result is then :data:`COLD_START_PROBE`, so one request reaches Serve, which starts a
        replica). Called after every poll, in order."""
        ...


COLD_START_PROBE = 1  # requests let through while a model has no live replica (see above)


def bounded(total: int, upper_bound: int | None) -> int:
    """``total`` within ``router.max_in_flight_per_model`` (if set), and at least the probe."""
    if upper_bound is not None:
        total = min(total, upper_bound)
    return max(COLD_START_PROBE, total)
