"""Capacity from the engines' own counts: keep every engine's waiting queue near empty.

vLLM starts a request when its token budget, KV cache and ``max_num_seqs`` allow; how many that
is depends on prompt lengths and memory, so no fixed number fits (measured on an H200: a fixed cap
of 512 = ``max_num_seqs`` left about 270 requests waiting FCFS inside vLLM while it ran about 230).

After each poll, per replica, ``pending = max(waiting, active - running)`` is what it was sent
but has not started (vLLM's waiting queue, plus requests still being tokenized, since the
engine's counts only move once per step). The replica's engine may hold ``running + room``
requests, where the room is

* ``queue`` when the engine is saturated (its batch is at ``max_num_seqs``, its KV cache nearly
  full, or it holds more than ``queue`` requests it has not started): what its next step can
  start (one step's budget of prompts, ``max_num_batched_tokens`` / recent prompt length, within
  the batch's free places: 8 prompts of 1,024 tokens on an H200) plus ``headroom``, so chunked
  prefill fills every step's token budget from the engine's own queue and the rest waits in the
  router's fair queue;
* ``max(queue, 2 x growth)`` otherwise (never past the free places plus ``headroom``),
  ``growth`` being how many more requests it ran at its latest step than at the one before: a burst ramps up as fast as the engine shows it can start
  work (4, 8, 16, ... per step), never faster, so the waiting queue stays near ``headroom``.

With ``batch_reserve`` (``router.admission.batch_reserve``, 0 unless set), the target stays
that many places below a full batch (``max_num_seqs``), with nothing of the backlog waiting in
the engine: those places are for the first requests of idle tenants, which the router lets in
beyond capacity (``first_request_slots``). A full batch starts a newcomer only when a running
request ends, and a backlog in the engine's queue takes those places as they free (the CPU
default, batch 64, without it: a quiet tenant's request waited 132 ms p50 in the engine's queue,
224 ms to its first token; with 2 places kept, 32 ms; 42a). The cost is those places while only
the backlog runs: 2 of a 64 batch, 3% (the cluster simulation's batch-bound engines fell below
its 95% utilisation bar with one place of 32 kept), so it is off by default.

Every replica's target also stays below what Serve lets it take at once: the model's
``max_ongoing_requests`` (``serve_limit``) less what each router may hold on it beside the
admitted requests (counted from the routers reporting demand to it): its output channel, a load
poll, and the ``headroom`` first requests of idle tenants it may let in beyond capacity. A request sent past that limit waits in Serve's handle, first come first served and
with Serve's retry backoff of up to a second, where no tenant's turn is kept (measured on the
CPU default, 64 = ``max_num_seqs`` = ``max_ongoing_requests``: a quiet tenant's first token took
1.3 s beside a 96-way flood, 1.15 s of it in Serve's hop; bench/RESULTS.md 42a).

The limit is absolute (what the engines run plus their small queues), not relative to what the
router has out: requests that finished in the engine but whose responses are still being sent
count in the router until they end, and a relative limit counted their places twice (measured:
a batch of 8 holding 17). Completions free their slots when their responses end (the admission
controller refills them between polls). Several router replicas share the result by demand
(:mod:`serve_app.admission.share`).
"""

from __future__ import annotations

from typing import Sequence

from serve_app.admission.policy import COLD_START_PROBE, bounded
from serve_app.engine.protocol import EngineLoad


class EngineFeedbackCapacity:
    """See the module docstring; ``upper_bound`` is ``router.max_in_flight_per_model``.

    Keeps, per replica, the running count of the engine's two latest distinct steps."""


    def __init__(self, headroom: int, kv_cache_high: float, upper_bound: int | None,
                 serve_limit: int | None = None, batch_reserve: int = 0) -> None:
        self.headroom = headroom
        self.kv_cache_high = kv_cache_high
        self.upper_bound = upper_bound
        self.serve_limit = serve_limit  # the model's max_ongoing_requests (None: no limit)
        self.batch_reserve = batch_reserve
        self._steps: dict[str, tuple[int, int]] = {}  # replica -> (running, growth)

    def _growth(self, r: EngineLoad) -> int:
        if r.replica not in self._steps:  # first sight: no step to compare with yet
            self._steps[r.replica] = (r.running, 0)
            return 0
        last, growth = self._steps[r.replica]
        if r.running != last:  # a new engine step since the previous poll
            growth = max(0, r.running - last)
            self._steps[r.replica] = (r.running, growth)
        return growth

    def replica_target(self, r: EngineLoad) -> int:
        """Requests this replica's engine should hold now: what it runs plus what it may wait,
        within what Serve lets the replica take at once (see the module docstring)."""
        ceilings = [self._engine_target(r)]
        if self.batch_reserve and r.max_running > 2 * self.batch_reserve:
            ceilings.append(r.max_running - self.batch_reserve)  # idle tenants' first requests
        if self.serve_limit is not None:
            ceilings.append(self.serve_limit - max(1, len(r.router_demand)) * (2 + self.headroom))
        return max(1, min(ceilings))

    def _engine_target(self, r: EngineLoad) -> int:
        growth = self._growth(r)
        free = r.max_running - r.running if r.max_running > 0 else None
        # What the next step can start: one step's budget of prompts, within the free places.
        startable = r.step_intake
        if free is not None:
            startable = min(startable, free)
        queue = startable + self.headroom
        pending = max(r.waiting, r.active - r.running)
        if pending > queue or r.kv_cache_usage >= self.kv_cache_high or free == 0:
            return r.running + queue
        room = max(queue, 2 * growth)
        if free is not None:  # never plan past the batch limit (plus the small queue)
            room = min(room, free + self.headroom)
        return r.running + room

    def capacity(self, replicas: Sequence[EngineLoad]) -> int:
        live = {r.replica for r in replicas}
        for gone in [k for k in self._steps if k not in live]:
            del self._steps[gone]
        if not replicas:
            return COLD_START_PROBE
        total = sum(self.replica_target(r) for r in replicas)
        return bounded(total, self.upper_bound)
