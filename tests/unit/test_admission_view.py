"""Admission that follows the replicas that exist now, and several routers sharing a model's
capacity by demand (pure logic: the admission controller, the router share and the engine feed
with a stand-in for Serve's broadcast)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from ray.serve.exceptions import DeploymentUnavailableError

from serve_app.admission import COLD_START_PROBE, capacity_policy
from serve_app.admission import feed as feed_module
from serve_app.admission.controller import AdmissionController, Slot
from serve_app.admission.feed import BUSY_PERIOD_CAP_S, POLL_TIMEOUT_S, EngineFeed
from serve_app.admission.share import DEMAND_SAMPLE, router_demands, router_share, water_fill
from serve_app.config import AdmissionSettings
from serve_app.engine.protocol import EngineLoad
from serve_app.engine.router_reports import (BACKLOG_REPORT_TTL_S, DEMAND_REPORT_TTL_S,
                                             RouterReports)
from serve_app.serve_private import broadcast_each


def _load(replica: str, running: int = 0, waiting: int = 0, active: int = 0,
          demand: tuple[tuple[str, int], ...] = ()) -> EngineLoad:
    return EngineLoad(running, waiting, max_running=8, step_tokens=2048, prefill_tokens_avg=512,
                      replica=replica, active=active or running + waiting, router_demand=demand)


# -- the router share -------------------------------------------------------------------------
def test_a_router_alone_with_the_load_gets_the_whole_engine_regression_split_by_count():
    """Two routers, all the load on one (uneven HAProxy spread): the fixed split by the router
    count gave it half, and the engine idled while that router queued."""
    assert router_share(512, "r1", {"r1": 900, "r2": 0}) == 512


def test_backlogged_routers_split_evenly_and_a_small_demand_gets_what_it_asks():
    assert router_share(100, "r1", {"r1": 500, "r2": 500}) == 50
    assert router_share(100, "r2", {"r1": 500, "r2": 10}) == 10
    assert router_share(100, "r1", {"r1": 500, "r2": 10}) == 90
    shares = water_fill(100, {"a": 5, "b": 40, "c": 400, "d": 400})
    assert shares["a"] == 5  # asks less than an even part: gets what it asks
    assert shares["b"] == pytest.approx(95 / 3) == shares["c"] == shares["d"]  # the rest, evenly
    assert abs(sum(shares.values()) - 100) < 1e-9


def test_a_router_with_no_demand_keeps_a_place_to_start_one():
    assert router_share(100, "r2", {"r1": 500, "r2": 0}) == COLD_START_PROBE
    assert router_share(100, "r1", {"r1": 0, "r2": 0}) == 50  # nobody asks: even


# -- the view ---------------------------------------------------------------------------------
def test_work_on_a_draining_replica_stops_counting_regression_scale_down_froze_admission():
    """200 streams on a replica that left the view (draining), an idle new replica with room
    for 4: queued requests are admitted at once instead of waiting for the old streams."""

    async def main() -> None:
        a = AdmissionController(400, 1000)
        slots = [Slot() for _ in range(200)]
        for slot in slots:
            await slot.acquire(a, "flood", "normal")
            slot.assign("old")
        a.set_capacity(4, live=["new"])
        waiting = [asyncio.ensure_future(a.acquire("t", "normal")) for _ in range(100)]
        await asyncio.sleep(0)
        assert sum(w.done() for w in waiting) == 4
        assert a.counted == 4 and a.in_flight == 204
        for slot in slots[:50]:  # old streams end: nothing is admitted for them
            slot.release(0)
        await asyncio.sleep(0)
        assert sum(w.done() for w in waiting) == 4 and a.off_view == 150
        a.set_capacity(4, live=["old", "new"])  # the old replica back in view: it counts
        assert a.counted == 154 and not a.has_room()
        for w in waiting:
            w.cancel()

    asyncio.run(main())


class _Handle:
    """Stands in for the LLMServer handle: what broadcast_each would return per replica."""

    def __init__(self, answer) -> None:
        self.answer = answer


@pytest.fixture
def feed(monkeypatch):
    calls: list[tuple] = []

    async def broadcast_each(handle, method, *args, timeout_s, answer_timeout_s=None):
        calls.append(args)
        result = handle.answer
        if isinstance(result, Exception):
            raise result
        return list(result)

    monkeypatch.setattr(feed_module, "broadcast_each", broadcast_each)

    def make(answer, router_id: str = "r1") -> tuple[EngineFeed, AdmissionController]:
        admission = AdmissionController(COLD_START_PROBE, 1000)
        policy = capacity_policy("engine_feedback", headroom=4, kv_cache_high=0.95,
                                 fixed_per_replica=64, upper_bound=None)
        f = EngineFeed("m", _Handle(answer), admission, policy, AdmissionSettings(), router_id)
        return f, admission

    make.calls = calls  # type: ignore[attr-defined]
    return make


def test_a_model_with_no_replica_has_an_empty_view_regression_stale_view_stood(feed):
    """Scaled to zero, Serve's broadcast raises; the view used to keep the last replicas (and
    their capacity), so requests skipped the fair queue into Serve's handle queue."""
    f, admission = feed([_load("a", running=8), _load("b", running=8)])
    replicas = asyncio.run(f.poll())
    assert f.apply(replicas) > COLD_START_PROBE
    f.handle.answer = DeploymentUnavailableError(SimpleNamespace(name="m", app_name="llm"))
    replicas = asyncio.run(f.poll())
    assert replicas == []
    assert f.apply(replicas) == COLD_START_PROBE and admission.capacity == COLD_START_PROBE


def test_a_replica_that_does_not_answer_drops_out_and_the_others_keep_admitting(feed):
    f, admission = feed([_load("a", running=4), asyncio.TimeoutError(), _load("c", running=4)])
    replicas = asyncio.run(f.poll())
    assert [r.replica for r in replicas] == ["a", "c"]
    f.apply(replicas)
    assert admission.live == {"a", "c"} and admission.capacity > COLD_START_PROBE


def test_a_failed_poll_keeps_the_previous_view(feed):
    f, _ = feed(RuntimeError("redeploying"))
    assert asyncio.run(f.poll()) is None


def test_the_feed_reports_its_demand_and_takes_its_share_by_everyones(feed):
    # Another router holds a large backlog; this one has 3 queued.
    f, admission = feed([_load("a", running=8, demand=(("r2", 1000),))])
    admission.in_flight = 1

    async def main() -> int:
        waiting = [asyncio.ensure_future(admission.acquire("t", "normal")) for _ in range(3)]
        await asyncio.sleep(0)
        replicas = await f.poll()
        capacity = f.apply(replicas)
        for w in waiting:
            w.cancel()
        return capacity

    capacity = asyncio.run(main())
    # router id, queued, in flight, then the prefix index state it holds (none yet)
    assert feed.calls[-1] == ("r1", 3, 1, {})
    total = capacity_policy("engine_feedback", headroom=4, kv_cache_high=0.95,
                            fixed_per_replica=64, upper_bound=None).capacity(
        [_load("a", running=8)])
    assert capacity == router_share(total, "r1", {"r1": 4, "r2": 1000}) == 4


def test_a_late_replica_keeps_its_last_load_until_the_poll_timeout(feed):
    """A replica that misses one answer deadline stays in the view with its last load (its
    work keeps counting: dropping it for one late answer let the routers admit its in-flight
    work again); one silent for POLL_TIMEOUT_S drops out."""
    f, admission = feed([])
    assert len(f.view_of([_load("a", running=4), _load("b", running=4)], 0, 10.0)) == 2
    view = f.view_of([_load("a", running=5)], 1, 10.5)  # b late
    assert [(r.replica, r.running) for r in view] == [("a", 5), ("b", 4)]
    f.apply(view)
    assert admission.live == {"a", "b"}
    assert [r.replica for r in f.view_of([_load("a")], 1, 10.0 + POLL_TIMEOUT_S + 0.1)] == ["a"]
    assert [r.replica for r in f.view_of([_load("a"), _load("b")], 0, 13.0)] == ["a", "b"]


def test_a_replica_serve_took_out_of_its_set_is_not_held(feed):
    """A draining replica is no longer called (it is not among the late answers): it leaves
    the view at once, so work on it stops counting."""
    f, _ = feed([])
    f.view_of([_load("a"), _load("b")], 0, 1.0)
    assert [r.replica for r in f.view_of([_load("a")], 0, 1.1)] == ["a"]


class _Result:
    def __init__(self, delay_s: float, value: object) -> None:
        self.delay_s, self.value, self.cancelled = delay_s, value, False

    async def get_async(self) -> object:
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return self.value


class _Broadcast:
    def __init__(self, results: list[_Result]) -> None:
        self.results = results

    def broadcast(self, method: str, *args: object) -> "_Broadcast":
        return self

    async def _fetch_replica_results_async(self) -> list[_Result]:
        return self.results


def test_one_slow_replica_costs_the_answer_deadline_not_its_delay():
    """broadcast_each returns the answers in hand at the deadline; the late call is given up
    (cancelled) and its place holds a TimeoutError (one gather over all answers held every
    poll to the slow replica's timeout: views fell from 48 to 15 a second)."""
    slow = _Result(30.0, "slow")
    handle = _Broadcast([_Result(0.0, "a"), slow, _Result(0.01, "c")])

    async def main() -> tuple[list[object], float]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        answers = await broadcast_each(handle, "engine_load", timeout_s=2.0,  # type: ignore
                                       answer_timeout_s=0.2)
        return answers, loop.time() - t0

    answers, took = asyncio.run(main())
    assert answers[0] == "a" and answers[2] == "c"
    assert isinstance(answers[1], asyncio.TimeoutError) and slow.cancelled
    assert took < 1.0


# -- the routers' reports on a replica --------------------------------------------------------
def test_a_dead_routers_demand_stops_counting_regression_stale_report_trapped_capacity():
    """A router that stopped reporting (crashed, restarted under a new id) held its share for
    the 3 s backlog TTL, and the engine-feedback capacity stayed trapped at what the live
    routers were let admit (74% of the engine at 4x8 in the simulation). Its demand now counts
    for DEMAND_REPORT_TTL_S; its queued backlog still reaches the autoscaler for longer; a
    router whose channel closed is forgotten at once."""
    now = [0.0]
    reports = RouterReports(clock=lambda: now[0])
    reports.record("dead", 7, 100)
    reports.record("live", 2, 50)
    assert dict(reports.demand()) == {"dead": 107, "live": 52}
    now[0] = DEMAND_REPORT_TTL_S + 0.01
    reports.record("live", 2, 50)
    assert dict(reports.demand()) == {"live": 52}
    assert reports.backlog() == 9
    now[0] = BACKLOG_REPORT_TTL_S + 0.01
    assert reports.backlog() == 2
    reports.forget("live")
    assert reports.demand() == () and reports.backlog() == 0


def test_demands_are_read_from_a_few_replicas_regression_apply_grew_as_routers_x_replicas():
    """Every replica holds every router's report: the first DEMAND_SAMPLE answers give them
    all (merging all 256 answers of 64 reports cost 4-5 ms per poll at 64x256)."""
    reps = [_load(f"x{i}", demand=(("r2", 10), ("r3", 20))) for i in range(DEMAND_SAMPLE)]
    reps.append(_load("late", demand=(("r2", 999),)))
    assert router_demands(reps, "r1", 5) == {"r1": 5, "r2": 10, "r3": 20}


def test_the_busy_poll_slows_with_the_routers_so_each_replica_answers_a_bounded_rate(feed):
    """Each poll costs a replica about 1.5 ms of CPU in Serve's call path (RESULTS 27b): with N
    routers the busy period is max(poll_interval_s, N / engine_polls_per_s)."""
    f, _ = feed([])
    assert f.busy_period() == AdmissionSettings().poll_interval_s  # no view yet: one router
    f.replicas = [_load("a", demand=(("r1", 3),))]
    assert f.busy_period() == AdmissionSettings().poll_interval_s
    f.replicas = [_load("a", demand=tuple((f"r{i}", 3) for i in range(4)))]
    assert f.busy_period() == pytest.approx(4 / AdmissionSettings().engine_polls_per_s)
    f.replicas = [_load("a", demand=tuple((f"r{i}", 3) for i in range(64)))]
    assert f.busy_period() == BUSY_PERIOD_CAP_S  # views no staler than the simulation allows
