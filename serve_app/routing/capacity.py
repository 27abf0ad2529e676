"""The admission-capacity contract: from the engines' live load to how many requests of one
model a router replica may have in flight.

Called by :class:`serve_app.ingress.engine_feed.EngineFeed` after every poll of the model's
replicas (many times a second while there is work); the result goes to the model's
:class:`serve_app.ingress.admission.AdmissionController`, which releases queued requests while
its in-flight count is below it. Policies are pure functions of the snapshot (no I/O, no Ray),
so they are unit-tested by driving them with scripted loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One LLMServer replica as its latest ``engine_load`` answer described it.

    ``active``: requests the replica is serving (tokenizing, in the engine, streaming out);
    ``running``/``waiting``: started and held-but-not-started requests in its engine, as of the
    engine's latest step; ``kv_cache_usage`` 0..1; ``max_running``: the engine's batch limit
    (vLLM's ``max_num_seqs``, 0 if unknown); ``step_tokens``: its per-step token budget
    (``max_num_batched_tokens``); ``prefill_tokens_avg``: the tokens its recent prompts needed
    computed, prefix-cache hits left out (0: unknown); ``direct``/``direct_key``: the address
    and key of its direct-start socket (:mod:`serve_app.engine.direct_start`; None: none);
    ``node``: the Ray node it runs on; ``requests_total``: requests it has taken since it
    started (how evenly routers spread them: `serve-app status`).
    """

    replica: str
    active: int
    running: int
    waiting: int
    kv_cache_usage: float = 0.0
    max_running: int = 0
    step_tokens: int = 0
    prefill_tokens_avg: float = 0.0
    direct: str | None = None
    direct_key: str = ""
    node: str = ""
    requests_total: int = 0

    @property
    def step_intake(self) -> int:
        """About how many waiting prompts one engine step can start (0: unknown)."""
        if self.step_tokens <= 0 or self.prefill_tokens_avg <= 0:
            return 0
        return int(self.step_tokens // max(1.0, self.prefill_tokens_avg))

    @classmethod
    def from_report(cls, report: dict) -> ReplicaLoad:
        return cls(replica=str(report["replica"]), active=int(report["active"]),
                   running=int(report["running"]), waiting=int(report["waiting"]),
                   kv_cache_usage=float(report.get("kv_cache_usage", 0.0)),
                   max_running=int(report.get("max_running", 0)),
                   step_tokens=int(report.get("step_tokens", 0)),
                   prefill_tokens_avg=float(report.get("prefill_tokens_avg", 0.0)),
                   direct=report.get("direct"), direct_key=str(report.get("direct_key", "")),
                   node=str(report.get("node", "")),
                   requests_total=int(report.get("requests_total", 0)))


class CapacityPolicy(Protocol):
    """Maps the live replicas' loads to this router replica's in-flight limit for the model."""

    def capacity(self, replicas: Sequence[ReplicaLoad], num_routers: int) -> int:
        """In-flight limit for one router replica; ``replicas`` are the live ones (possibly
        none: the result is then 1, so one request reaches Serve, which starts a replica).
        Called after every poll, in order."""
        ...


COLD_START_PROBE = 1  # requests let through while a model has no live replica (see above)


def capacity_policy(name: str, *, headroom: int, kv_cache_high: float,
                    fixed_per_replica: int, upper_bound: int | None) -> CapacityPolicy:
    """The policy configured as ``router.admission.policy``."""
    from serve_app.routing.engine_feedback import EngineFeedbackCapacity
    from serve_app.routing.fixed import FixedCapacity

    if name == "engine_feedback":
        return EngineFeedbackCapacity(headroom, kv_cache_high, upper_bound)
    if name == "fixed":
        return FixedCapacity(fixed_per_replica, upper_bound)
    raise ValueError(f"unknown admission policy {name!r}")


def share(total: int, num_routers: int, upper_bound: int | None) -> int:
    """One router replica's share of ``total`` (each router holds its own queue), bounded."""
    per_router = -(-total // max(1, num_routers))
    if upper_bound is not None:
        per_router = min(per_router, -(-upper_bound // max(1, num_routers)))
    return max(COLD_START_PROBE, per_router)
