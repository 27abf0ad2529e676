"""Capacity from the engines' own counts: keep every engine's waiting queue near empty.

vLLM starts a request when its token budget, KV cache and ``max_num_seqs`` allow; how many that
is depends on prompt lengths and memory, so no fixed number fits (measured on an H200: a fixed cap
of 512 = ``max_num_seqs`` left about 270 requests waiting FCFS inside vLLM while it ran about 230).

After each poll, per replica, ``pending = max(waiting, active - running)`` is what it was sent
but has not started (vLLM's waiting queue, plus requests still being tokenized or in transit,
since the engine's counts only move once per step). The replica may get ``allowance - pending``
more requests than the router has in flight now, where the allowance is

* ``queue`` when the engine is saturated (its batch is at ``max_num_seqs``, its KV cache nearly
  full, or it holds more than ``queue`` requests it has not started): what its next step can
  start (one step's budget of prompts, ``max_num_batched_tokens`` / recent prompt length, within
  the batch's free places: 8 prompts of 1,024 tokens on an H200) plus ``headroom``, so chunked
  prefill fills every step's token budget from the engine's own queue and the rest waits in the
  router's fair queue;
* ``max(queue, 2 x growth)`` otherwise (never past the free places plus ``headroom``), ``growth`` being how many more requests it ran at its
  latest step than at the one before: a burst ramps up as fast as the engine shows it can start
  work (4, 8, 16, ... per step), never faster, so the waiting queue stays near ``headroom``.

Completions free their slots at once (the admission controller refills them between polls), so
the engine's batch stays full; polls only move the limit. With several router replicas each
takes its share of the allowance.
"""

from __future__ import annotations

from typing import Sequence

from serve_app.routing.capacity import COLD_START_PROBE, ReplicaLoad


class EngineFeedbackCapacity:
    """See the module docstring; ``upper_bound`` is ``router.max_in_flight_per_model``.

    Keeps, per replica, the running count of the engine's two latest distinct steps."""

    def __init__(self, headroom: int, kv_cache_high: float, upper_bound: int | None) -> None:
        self.headroom = headroom
        self.kv_cache_high = kv_cache_high
        self.upper_bound = upper_bound
        self._steps: dict[str, tuple[int, int]] = {}  # replica -> (running, growth)

    def _growth(self, r: ReplicaLoad) -> int:
        if r.replica not in self._steps:  # first sight: no step to compare with yet
            self._steps[r.replica] = (r.running, 0)
            return 0
        last, growth = self._steps[r.replica]
        if r.running != last:  # a new engine step since the previous poll
            growth = max(0, r.running - last)
            self._steps[r.replica] = (r.running, growth)
        return growth

    def allowance(self, r: ReplicaLoad) -> int:
        """Requests this replica may be sent beyond what it holds now (may be negative)."""
        growth = self._growth(r)
        free = r.max_running - r.running if r.max_running > 0 else None
        # What the next step can start: one step's budget of prompts, within the free places.
        startable = r.step_intake
        if free is not None:
            startable = min(startable, free)
        queue = startable + self.headroom
        pending = max(r.waiting, r.active - r.running)
        if pending > queue or r.kv_cache_usage >= self.kv_cache_high or free == 0:
            return queue - pending
        room = max(queue, 2 * growth)
        if free is not None:  # never plan past the batch limit (plus the small queue)
            room = min(room, free + self.headroom)
        return room - pending

    def capacity(self, replicas: Sequence[ReplicaLoad], num_routers: int, in_flight: int) -> int:
        live = {r.replica for r in replicas}
        for gone in [k for k in self._steps if k not in live]:
            del self._steps[gone]
        if not replicas:
            return COLD_START_PROBE
        allowance = sum(self.allowance(r) for r in replicas)
        share = allowance / max(1, num_routers)
        cap = in_flight + (int(share) if share >= 0 else -int(-share))
        if self.upper_bound is not None:
            cap = min(cap, -(-self.upper_bound // max(1, num_routers)))
        return max(COLD_START_PROBE, cap)
