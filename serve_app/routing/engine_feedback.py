"""Capacity from the engines' own counts: keep every engine's waiting queue near empty.

vLLM starts a request when its token budget, KV cache and ``max_num_seqs`` allow; how many that
is depends on prompt lengths and memory, so no fixed number fits (measured on an H200: a fixed cap
of 512 = ``max_num_seqs`` left about 270 requests waiting FCFS inside vLLM while it ran about 230).
Per replica:

* **saturated** (more than ``headroom`` requests sent but not started, or the KV cache nearly
  full, or the batch at ``max_num_seqs``): ``running + headroom``. The engine keeps a small
  queue to start from at its next step; the rest waits in the router's fair queue.
* **hungry** (it started nearly everything it was sent): ``2 x running + headroom``, capped at
  ``max_num_seqs + headroom``. Growth needs ``running`` to grow, which takes engine steps, so a
  burst ramps up in a few steps (4, 8, 16, ... per poll) and polling faster cannot overshoot.

"Sent but not started" is ``max(waiting, active - running)``: requests still being tokenized or
in transit count too, since the engine's counts only move once per step.
The model's total is the sum over live replicas, shared between router replicas.
"""

from __future__ import annotations

from typing import Sequence

from serve_app.routing.capacity import COLD_START_PROBE, ReplicaLoad, share


class EngineFeedbackCapacity:
    """See the module docstring; ``upper_bound`` is ``router.max_in_flight_per_model``."""

    def __init__(self, headroom: int, kv_cache_high: float, upper_bound: int | None) -> None:
        self.headroom = headroom
        self.kv_cache_high = kv_cache_high
        self.upper_bound = upper_bound

    def replica_capacity(self, r: ReplicaLoad) -> int:
        pending = max(r.waiting, r.active - r.running)
        full_batch = r.max_running > 0 and r.running >= r.max_running
        if pending > self.headroom or r.kv_cache_usage >= self.kv_cache_high or full_batch:
            return r.running + self.headroom
        grown = 2 * r.running
        if r.max_running > 0:
            grown = min(grown, r.max_running)
        return grown + self.headroom

    def capacity(self, replicas: Sequence[ReplicaLoad], num_routers: int) -> int:
        if not replicas:
            return COLD_START_PROBE
        total = sum(self.replica_capacity(r) for r in replicas)
        return share(total, num_routers, self.upper_bound)
