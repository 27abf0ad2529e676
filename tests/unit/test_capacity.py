"""Admission capacity from the engines' live load (serve_app/routing), driven by scripted loads."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.ingress.admission import AdmissionController, NoReplicaInTime
from serve_app.routing.capacity import COLD_START_PROBE, ReplicaLoad, capacity_policy
from serve_app.routing.engine_feedback import EngineFeedbackCapacity
from serve_app.routing.fixed import FixedCapacity


def load(active=0, running=0, waiting=0, kv=0.0, max_running=512, name="r0") -> ReplicaLoad:
    return ReplicaLoad(name, active, running, waiting, kv, max_running)


def policy(headroom=4, kv_high=0.95, bound=None) -> EngineFeedbackCapacity:
    return EngineFeedbackCapacity(headroom, kv_high, bound)


def test_no_live_replica_lets_one_request_through_to_wake_the_model():
    assert policy().capacity([], 1) == COLD_START_PROBE == 1
    assert FixedCapacity(64, None).capacity([], 1) == 1


def test_saturated_engine_gets_what_it_runs_plus_headroom():
    # The H200 flood: the engine ran ~230 while ~280 waited FCFS inside vLLM.
    assert policy().capacity([load(active=510, running=230, waiting=280)], 1) == 234


def test_full_kv_cache_or_full_batch_stops_growth():
    assert policy().capacity([load(active=100, running=100, kv=0.97)], 1) == 104
    assert policy().capacity([load(active=512, running=512, max_running=512)], 1) == 516


def test_hungry_engine_ramps_up_by_doubling_within_its_batch_limit():
    p = policy()
    caps, running = [], 0
    for _ in range(9):  # each poll the engine started everything it was sent
        cap = p.capacity([load(active=running, running=running)], 1)
        caps.append(cap)
        running = min(cap, 512)  # the engine never runs more than max_num_seqs
    assert caps[:4] == [4, 12, 28, 60]
    assert caps[-1] == 516  # max_num_seqs + headroom
    assert max(caps) == 516


def test_requests_in_transit_count_as_not_started():
    # 40 sent requests are still being tokenized: vLLM's own waiting says 0.
    assert policy().capacity([load(active=140, running=100, waiting=0)], 1) == 104


def test_capacity_follows_the_replicas_that_exist():
    p = policy()
    one = p.capacity([load(active=230, running=230, waiting=10)], 1)
    two = p.capacity([load(active=230, running=230, waiting=10, name="a"),
                      load(active=230, running=230, waiting=10, name="b")], 1)
    assert two == 2 * one


def test_router_replicas_share_the_capacity_and_the_upper_bound_holds():
    loads = [load(active=230, running=230, waiting=10)]
    assert policy().capacity(loads, 2) == 117
    assert policy(bound=100).capacity(loads, 1) == 100
    assert policy(bound=100).capacity(loads, 4) == 25


def test_fixed_policy_is_per_live_replica():
    p = capacity_policy("fixed", headroom=4, kv_cache_high=0.9, fixed_per_replica=64,
                        upper_bound=None)
    assert p.capacity([load(name="a"), load(name="b")], 1) == 128


def test_admission_follows_capacity_changes_and_cold_start_expires():
    async def main() -> None:
        a = AdmissionController(1, 100)
        await a.acquire("t", "normal")  # the cold-start probe
        waiters = [asyncio.ensure_future(a.acquire("t", "normal")) for _ in range(3)]
        await asyncio.sleep(0)
        assert a.queued() == 3 and a.blocked.is_set()
        a.set_capacity(3)  # the first replica is up and hungry
        await asyncio.sleep(0)
        assert sum(w.done() for w in waiters) == 2 and a.in_flight == 3
        assert a.expire_waiting(older_than_s=-1) == 1  # no replica for too long
        await asyncio.sleep(0)
        with pytest.raises(NoReplicaInTime):
            waiters[2].result()
        assert a.queued() == 0 and not a.blocked.is_set() and a.in_flight == 3
    asyncio.run(main())


def test_admission_hands_out_the_fair_queues_engine_priority():
    async def main() -> None:
        a = AdmissionController(10, 100)
        a.queue.charge("heavy", 10_000)
        light = await a.acquire("light", "normal")
        heavy = await a.acquire("heavy", "normal")
        high = await a.acquire("heavy", "high")
        assert high < light < heavy
    asyncio.run(main())
