"""Admission: how much work each model's engines may have in flight now, and who goes next.

* :mod:`.controller`: the per-model in-flight limit and fair queue of one router replica.
* :mod:`.feed`: polls the live engine replicas' load (:class:`~serve_app.engine.protocol.EngineLoad`)
  and moves the limit.
* Capacity policies (one per file, behind :class:`.policy.CapacityPolicy`), chosen by name in
  ``router.admission.policy``: :data:`CAPACITY_POLICIES` is the registry.
"""

from __future__ import annotations

from typing import Callable

from serve_app.admission.engine_feedback import EngineFeedbackCapacity
from serve_app.admission.fixed import FixedCapacity
from serve_app.admission.policy import COLD_START_PROBE, CapacityPolicy

# name -> factory(headroom, kv_cache_high, fixed_per_replica, upper_bound, batch_reserve);
# fixed_per_replica is
# the model's max_ongoing_requests: Serve's limit per replica (engine_feedback plans within it;
# fixed, the baseline, is that limit).
CAPACITY_POLICIES: dict[str, Callable[..., CapacityPolicy]] = {
    "engine_feedback": lambda *, headroom, kv_cache_high, fixed_per_replica, upper_bound,
    batch_reserve: EngineFeedbackCapacity(headroom, kv_cache_high, upper_bound,
                                          serve_limit=fixed_per_replica,
                                          batch_reserve=batch_reserve),
    "fixed": lambda *, headroom, kv_cache_high, fixed_per_replica, upper_bound, batch_reserve:
        FixedCapacity(fixed_per_replica, upper_bound),
}


def capacity_policy(name: str, *, headroom: int, kv_cache_high: float,
                    fixed_per_replica: int, upper_bound: int | None,
                    batch_reserve: int = 0) -> CapacityPolicy:
    """The policy configured as ``router.admission.policy`` (a name in
    :data:`CAPACITY_POLICIES`)."""
    try:
        factory = CAPACITY_POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown admission policy {name!r}; one of "
                         f"{sorted(CAPACITY_POLICIES)}") from None
    return factory(headroom=headroom, kv_cache_high=kv_cache_high,
                   fixed_per_replica=fixed_per_replica, upper_bound=upper_bound,
                   batch_reserve=batch_reserve)


__all__ = ["CAPACITY_POLICIES", "COLD_START_PROBE", "CapacityPolicy", "capacity_policy"]
