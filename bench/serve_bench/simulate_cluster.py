"""The simulated cluster: engine replicas in Serve's replica set, router replicas with the real
admission classes, and the load poll between them (for :mod:`serve_bench.simulate`).

Each router holds the real :class:`~serve_app.admission.controller.AdmissionController` and the
real :class:`~serve_app.admission.feed.EngineFeed` (its handle unused): the simulation only
stands in for the poll itself, then calls ``EngineFeed.apply``, so the capacity policy, the
share by demand and the view go through the project's own code. The poll mirrors
``EngineFeed._run`` and ``serve_private.broadcast_each``: every replica in Serve's set records
the router's report (queued, in flight) and answers its load with every fresh report (one
:class:`~serve_app.engine.router_reports.RouterReports` stands for every replica's identical
copy); a slow replica misses the answer deadline, so the poll takes ``ANSWER_DEADLINE_S`` and
``EngineFeed.view_of`` holds its last answer until ``POLL_TIMEOUT_S``. A router that dies
closes its output channels, and the replicas forget its report. A replica that is draining
has left Serve's set: it takes no new request and no poll, and finishes its own. Replica choice is Serve's power of two choices
among the serving replicas, by requests on each.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from serve_app.admission import COLD_START_PROBE, capacity_policy
from serve_app.admission.controller import AdmissionController, QueueFull, Slot
from serve_app.admission.feed import ANSWER_DEADLINE_S, EngineFeed
from serve_bench.simulate_engine import EngineShape, SimReplica, SimRequest
from serve_app.config import AdmissionSettings
from serve_app.engine.router_reports import DEMAND_REPORT_TTL_S, RouterReports
from serve_app.governance.fair_queue import service_of

POLL_RTT_S = 0.001  # a broadcast's answers when every replica answers at once


class SimRouter:
    """One router replica: admission, engine feed and the requests it carries."""

    def __init__(self, rid: str, settings: AdmissionSettings, max_queued: int) -> None:
        self.rid = rid
        self.settings = settings
        self.admission = AdmissionController(COLD_START_PROBE, max_queued, policy="fair",
                                             first_request_slots=settings.headroom)
        policy = capacity_policy(settings.policy, headroom=settings.headroom,
                                 kv_cache_high=settings.kv_cache_high, fixed_per_replica=64,
                                 upper_bound=None)
        # The handle is never used: the simulation polls and calls apply itself.
        self.feed = EngineFeed("sim", None, self.admission, policy,  # type: ignore[arg-type]
                               settings, rid)
        self.alive = True
        self.requests: set[asyncio.Task[Any]] = set()
        self.feed_task: asyncio.Task[None] | None = None
        self.apply_s = 0.0  # CPU time spent in EngineFeed.apply (what a real router spends)
        self.applies = 0


class SimCluster:
    def __init__(self, shape: EngineShape, settings: AdmissionSettings, seed: int = 0,
                 report_ttl_s: float = DEMAND_REPORT_TTL_S,
                 channel_goodbye: bool = True) -> None:
        self.shape = shape
        self.settings = settings
        self.replicas: dict[str, SimReplica] = {}
        self.serving: list[SimReplica] = []
        self.reports = RouterReports(clock=lambda: asyncio.get_running_loop().time(),
                                     demand_ttl_s=report_ttl_s)
        self.channel_goodbye = channel_goodbye  # a dead router's report is forgotten at once
        self.rng = random.Random(seed)
        self.failed = 0  # requests cut or refused by a router that went away
        self.rejected = 0  # 429s (a band's queue full)
        self.measure_from = 0.0

    # -- Serve's replica set ----------------------------------------------------------------
    def add_replica(self, name: str) -> SimReplica:
        loop = asyncio.get_running_loop()
        r = SimReplica(name, self.shape, joined_at=loop.time())
        self.replicas[name] = r
        self.serving.append(r)
        loop.create_task(r.run(self.measure_from))
        return r

    def drain(self, r: SimReplica) -> None:
        """Serve stops the replica: out of the set (no new request, no poll); it finishes."""
        r.state, r.drain_at = "draining", asyncio.get_running_loop().time()
        self.serving.remove(r)
        if r.active == 0:
            r.state = "gone"
            r._wake.set()

    def choose(self) -> SimReplica | None:
        """Serve's power of two choices among the serving replicas (fewer requests wins)."""
        if not self.serving:
            return None
        a, b = self.rng.choice(self.serving), self.rng.choice(self.serving)
        return a if a.active <= b.active else b

    # -- the load poll ----------------------------------------------------------------------
    def poll(self, router: SimRouter) -> tuple[list[Any], float]:
        """What ``broadcast_each(engine_load)`` gives ``router`` now: the loads of the replicas
        that answer in time, and how long the gather takes."""
        a = router.admission
        self.reports.record(router.rid, a.queued(), a.in_flight)
        everyone = self.reports.demand()
        loads = [r.load(everyone) for r in self.serving if not r.slow]
        late = sum(r.slow for r in self.serving)
        now = asyncio.get_running_loop().time()
        return router.feed.view_of(loads, late, now), ANSWER_DEADLINE_S if late else POLL_RTT_S

    async def run_feed(self, router: SimRouter) -> None:
        """``EngineFeed._run`` on the simulated poll."""
        s = router.settings
        a = router.admission
        while router.alive:
            loads, delay = self.poll(router)
            await asyncio.sleep(delay)
            if not router.alive:
                return
            started = time.process_time()
            router.feed.apply(loads)
            router.apply_s += time.process_time() - started
            router.applies += 1
            if a.in_flight or len(a.queue):
                await asyncio.sleep(router.feed.busy_period())
            else:
                try:
                    await asyncio.wait_for(a.blocked.wait(), s.idle_poll_interval_s)
                except asyncio.TimeoutError:
                    pass

    def start_router(self, router: SimRouter) -> None:
        router.feed_task = asyncio.get_running_loop().create_task(self.run_feed(router))

    def kill_router(self, router: SimRouter) -> None:
        """The router replica dies: its feed stops, its queued and streaming requests fail (the
        engines abort the streams it carried). Its output channels close, so the replicas forget
        its report (without channels, the report stays until the demand TTL)."""
        router.alive = False
        if self.channel_goodbye:
            self.reports.forget(router.rid)
        if router.feed_task is not None:
            router.feed_task.cancel()
        for task in list(router.requests):
            task.cancel()

    # -- one request through a router -------------------------------------------------------
    async def request(self, router: SimRouter, tenant: str, prompt: int, output: int
                      ) -> tuple[float, float] | None:
        """Send one request through ``router`` as the pipeline does; (queue wait, time to the
        first token) or None when it failed (the client retries)."""
        task = asyncio.get_running_loop().create_task(self._request(router, tenant, prompt,
                                                                    output))
        router.requests.add(task)
        await asyncio.wait([task])
        router.requests.discard(task)
        if task.cancelled():
            self.failed += 1
            return None
        return task.result()

    async def _request(self, router: SimRouter, tenant: str, prompt: int, output: int
                       ) -> tuple[float, float] | None:
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        slot = Slot()
        try:
            await slot.acquire(router.admission, tenant, "normal")
        except QueueFull:
            self.rejected += 1
            return None
        waited = loop.time() - arrived
        req = SimRequest(tenant, prompt, output, slot.priority, loop.create_future(),
                         loop.create_future())
        replica = self.choose()
        try:
            if replica is None:
                return None
            replica.submit(req, loop.time())
            slot.assign(await req.first)
            ttft = loop.time() - arrived
            await req.done
            return waited, ttft
        finally:
            if replica is not None and not req.finished:
                replica.abort(req)
            slot.release(service_of(prompt, req.decoded))


__all__ = ["SimCluster", "SimRouter"]
