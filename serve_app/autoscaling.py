"""Queue-depth autoscaling of one model's LLMServer deployment (a Ray Serve custom policy).

Demand is what waits for the model plus what its engines hold:

* ``router_queued``: requests in the routers' fair queues. The routers report it to every replica
  with each load poll; each replica passes the latest figure on (``record_autoscaling_stats``),
  so the policy takes the largest over replicas (they all hold the same number);
* ``in_engine``: per replica, requests it serves (running + waiting in vLLM, or in transit);
* Serve's own handle queue (``total_queued_requests``): requests sent while no replica had room,
  e.g. the one request a router lets through to wake a model scaled to zero.

Desired replicas = ceil(demand / target_per_replica) within the bounds. Down: one replica at a
time, and only once ``current - 1`` replicas would run at most ``downscale_utilization`` of
their target (hysteresis). Serve applies the delays (``upscale_delay_s``, ``downscale_delay_s``,
``downscale_to_zero_delay_s``) and the min/max bounds around this function, and skips the delay
when scaling up from zero.

The policy runs in the Serve controller every 0.1 s; it must be cheap and must not block.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("ray.serve")

ROUTER_QUEUED = "router_queued"
IN_ENGINE = "in_engine"


@dataclass(frozen=True, slots=True)
class Decision:
    """One evaluation: the demand seen, the replicas wanted and why."""

    demand: float
    desired: int
    reason: str


def decide(demand: float, current: int, target_per_replica: float, min_replicas: int,
           max_replicas: int, downscale_utilization: float) -> Decision:
    """Pure decision (unit-tested): the replica count ``demand`` calls for, given ``current``."""
    # Averaged counts leave fractions; below half a request there is no demand.
    wanted = math.ceil(demand / target_per_replica) if demand >= 0.5 else 0
    wanted = min(max(wanted, min_replicas), max_replicas)
    if wanted > current:
        return Decision(demand, wanted, f"demand {demand:.0f} > {current} x {target_per_replica:g}")
    if wanted < current:
        fewer = current - 1
        room = fewer * target_per_replica * downscale_utilization
        if fewer >= min_replicas and demand <= room:
            return Decision(demand, fewer, f"demand {demand:.0f} <= {room:.0f} "
                            f"({fewer} x {target_per_replica:g} x {downscale_utilization:g})")
        return Decision(demand, current, "within hysteresis")
    return Decision(demand, current, "steady")


def demand_of(ctx: Any) -> float:
    """The model's demand from an ``AutoscalingContext`` (see the module docstring).

    Serve's own ``total_num_requests`` is used only before any replica has reported: it also
    counts the routers' load polls in flight, which would keep an idle model from reaching zero.
    """
    metrics = ctx.aggregated_metrics or {}
    engines = metrics.get(IN_ENGINE) or {}
    handle_queued = float(ctx.total_queued_requests or 0.0)
    if not engines:
        return max(handle_queued, float(ctx.total_num_requests or 0.0))
    router_queued = max((metrics.get(ROUTER_QUEUED) or {}).values(), default=0.0)
    return sum(engines.values()) + router_queued + handle_queued


class QueueDepthPolicy:
    """Serve ``AutoscalingPolicy`` class (``policy_kwargs`` from :class:`AutoscalingSettings`)."""

    def __init__(self, target_per_replica: float, downscale_utilization: float,
                 model: str = "") -> None:
        self.target_per_replica = target_per_replica
        self.downscale_utilization = downscale_utilization
        self.model = model

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        state = dict(ctx.policy_state or {})
        d = decide(demand_of(ctx), ctx.current_num_replicas, self.target_per_replica,
                   ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas,
                   self.downscale_utilization)
        # One log line per change of mind, with its reason (the controller calls us 10x/s).
        if d.desired != state.get("last_desired"):
            logger.info("autoscaling %s: %d -> %d replicas wanted (%s)",
                        self.model or ctx.deployment_name, ctx.current_num_replicas, d.desired,
                        d.reason)
            state["last_desired"] = d.desired
        state["demand"] = d.demand
        return d.desired, state
