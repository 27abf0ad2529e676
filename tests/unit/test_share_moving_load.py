"""Routers sharing an engine by demand while the load moves between them (issue 37, finding
8): pure, two routers' real admission controllers and engine feeds driven poll by poll over a
modelled engine (no Ray, no clock)."""

from __future__ import annotations

import asyncio
from collections import deque

from serve_app.admission import capacity_policy
from serve_app.admission.controller import AdmissionController
from serve_app.admission.feed import EngineFeed
from serve_app.admission.share import share_of
from serve_app.config import AdmissionSettings
from serve_app.engine.protocol import EngineLoad

BATCH = 64  # the engine's max_num_seqs
STEP_TOKENS, PROMPT = 2048, 512  # one step starts 4 prompts
HEADROOM = 4
ONE_STEP = STEP_TOKENS // PROMPT


class TwoRouters:
    """One engine replica and two routers; every request a router admits goes to the engine
    at once, which runs ``BATCH`` of them and queues the rest (vLLM's waiting)."""

    def __init__(self) -> None:
        settings = AdmissionSettings(headroom=HEADROOM)
        self.admission = {rid: AdmissionController(1, 10_000) for rid in ("A", "B")}
        self.feeds = {rid: EngineFeed("m", None, a,  # type: ignore[arg-type]
                                      capacity_policy("engine_feedback", headroom=HEADROOM,
                                                      kv_cache_high=0.95, fixed_per_replica=2 * BATCH,
                                                      upper_bound=None), settings, rid)
                      for rid, a in self.admission.items()}
        self.reports: dict[str, int] = {}
        self.worst_waiting = 0

    def load(self) -> EngineLoad:
        sent = sum(a.in_flight for a in self.admission.values())
        running = min(sent, BATCH)
        return EngineLoad(running, sent - running, max_running=BATCH, step_tokens=STEP_TOKENS,
                          prefill_tokens_avg=PROMPT, replica="e", active=sent,
                          router_demand=tuple(self.reports.items()))

    async def poll(self) -> None:
        """Both routers poll at once (the same engine snapshot), then apply their views."""
        for rid, a in self.admission.items():
            self.reports[rid] = a.in_flight + a.queued()
        view = [self.load()]
        for feed in self.feeds.values():
            feed.apply(view)
        await asyncio.sleep(0)  # the admitted waiters run
        self.worst_waiting = max(self.worst_waiting, self.load().waiting)

    def queue(self, rid: str, n: int) -> list[asyncio.Future[int]]:
        a = self.admission[rid]
        return [asyncio.ensure_future(a.acquire(f"{rid}-tenant", "normal")) for _ in range(n)]


def test_load_moving_between_routers_under_long_streams_stays_within_the_engine_regression_over_admits_while_load_moves():
    """Router A holds the engine's batch in long streams; then a backlog arrives on router B.
    B's water-filled share is half the capacity, but A's streams run on: the shares alone sent
    B half the capacity on top of A's streams (about 1.5 x the engine: 768 to engines sized for
    512), all waiting inside the engine, outside the fair queue. B may take only the room the
    engine has free, and reaches its even part as A's streams end."""

    async def main() -> TwoRouters:
        c = TwoRouters()
        long = deque(c.queue("A", BATCH + 16))
        for _ in range(12):  # A alone: it fills the engine
            await c.poll()
        assert c.admission["A"].in_flight >= BATCH
        c.worst_waiting = 0
        c.queue("B", 400)
        for _ in range(40):  # the backlog on B; one of A's long streams ends per poll
            await c.poll()
            while long and not long[0].done():
                long.rotate(-1)
            if long and long[0].done():
                long.popleft()
                c.admission["A"].release("A-tenant", 1.0)
        for f in list(long) + [w for w in asyncio.all_tasks() if w is not
                               asyncio.current_task()]:
            f.cancel()
        return c

    c = asyncio.run(main())
    # What the fair design lets an engine hold unstarted: the headroom, plus one step's worth.
    assert c.worst_waiting <= HEADROOM + ONE_STEP, c.worst_waiting
    # B got its even part of the engine once A's streams had ended (not stuck at the probe).
    assert c.admission["B"].in_flight >= BATCH // 2 - 2


def test_a_router_alone_gets_the_whole_capacity_under_the_bound():
    """Under the growth bound a lone busy router still gets everything: the other router's
    demand is zero, so the engine's whole free room is its own."""
    load = EngineLoad(40, 0, max_running=64, step_tokens=2048, prefill_tokens_avg=512,
                      replica="e", active=40, router_demand=(("r1", 900), ("r2", 0)))
    assert share_of(200, [load], "r1", queued=860, in_flight=40) == 200
    # Nothing out yet (a cold engine): the whole capacity at once.
    idle = EngineLoad(0, 0, max_running=64, replica="e", router_demand=(("r2", 0),))
    assert share_of(68, [idle], "r1", queued=500, in_flight=0) == 68


def test_a_router_over_its_share_starts_nothing_and_the_others_split_the_free_room():
    """Router A holds 60 streams of an engine with room for 68, its share now 17 of 4 routers;
    B, C and D each queue 50 and hold nothing: together they may take the 8 free places, not
    their 51 of water-filled shares."""
    demands = (("A", 60), ("B", 50), ("C", 50), ("D", 50))
    load = EngineLoad(60, 0, max_running=64, step_tokens=2048, prefill_tokens_avg=512,
                      replica="e", active=60, router_demand=demands)
    assert share_of(68, [load], "A", queued=0, in_flight=60) == 17  # below its 60: no refill
    others = [share_of(68, [load], rid, queued=50, in_flight=0) for rid in "BCD"]
    assert sum(others) <= 8 + 3  # the free room, plus one place per router for rounding
    assert min(others) >= 1


def test_the_bound_does_not_stall_a_router_whose_peer_has_no_room_left():
    """r2 queues 993 but its share leaves it one more place; r1's small queue takes the rest of
    the free room rather than the queue-weighted crumb of it."""
    load = EngineLoad(8, 0, max_running=8, step_tokens=2048, prefill_tokens_avg=512,
                      replica="a", active=8, router_demand=(("r2", 1000),))
    assert share_of(12, [load], "r1", queued=3, in_flight=1) == 4
