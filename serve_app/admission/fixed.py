"""The baseline: a fixed number of requests per live replica, blind to what the engine runs.

Kept for comparisons (``router.admission.policy: fixed``): it is what the router did before
capacity followed the engines, and what a plain ``max_ongoing_requests`` gives.
"""

from __future__ import annotations

from typing import Sequence

from serve_app.admission.policy import COLD_START_PROBE, bounded
from serve_app.engine.protocol import EngineLoad


class FixedCapacity:
    def __init__(self, per_replica: int, upper_bound: int | None) -> None:
        self.per_replica = per_replica
        self.upper_bound = upper_bound

    def capacity(self, replicas: Sequence[EngineLoad]) -> int:
        if not replicas:
            return COLD_START_PROBE
        return bounded(self.per_replica * len(replicas), self.upper_bound)
