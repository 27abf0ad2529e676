"""Admission capacity from the engines' live load (serve_app/routing), driven by scripted loads."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.admission.controller import AdmissionController, NoReplicaInTime
from serve_app.admission import COLD_START_PROBE, capacity_policy
from serve_app.admission.engine_feedback import EngineFeedbackCapacity
from serve_app.admission.fixed import FixedCapacity
from serve_app.engine.protocol import EngineLoad
from serve_app.governance.fair_queue import engine_priority


def load(active=0, running=0, waiting=0, kv=0.0, max_running=512, name="r0") -> EngineLoad:
    return EngineLoad(running, waiting, kv_cache_usage=kv, max_running=max_running, replica=name,
                      active=active)


def policy(headroom=4, kv_high=0.95, bound=None) -> EngineFeedbackCapacity:
    return EngineFeedbackCapacity(headroom, kv_high, bound)


def test_no_live_replica_lets_one_request_through_to_wake_the_model():
    assert policy().capacity([]) == COLD_START_PROBE == 1
    assert FixedCapacity(64, None).capacity([]) == 1


def test_saturated_engine_holds_what_it_runs_plus_headroom():
    p = policy()
    # The H200 flood: the engine ran ~230 while ~280 waited FCFS inside vLLM.
    assert p.capacity([load(active=510, running=230, waiting=280)]) == 234
    assert p.capacity([load(active=512, running=512, max_running=512)]) == 516
    assert p.capacity([load(active=100, running=100, kv=0.97)]) == 104


def test_a_burst_ramps_up_at_the_pace_the_engine_starts_work():
    p = policy()
    in_flight, caps = 0, []
    for _ in range(12):
        # The engine started everything it had been sent at its last step (up to its batch).
        running = min(in_flight, 512)
        cap = p.capacity([load(active=in_flight, running=running)])
        caps.append(cap)
        in_flight = cap  # a deep backlog: the router fills every slot it gets
    assert caps[:5] == [4, 12, 28, 60, 124], caps
    assert max(caps) == 516  # max_num_seqs + headroom, never more


def test_no_growth_without_a_new_engine_step():
    p = policy()
    p.capacity([load(active=40, running=40)])
    assert p.capacity([load(active=80, running=80)]) == 80 + 80  # grew by 40
    # Polled again within the same engine step: the 80 sent since are still pending, so the
    # limit falls back to what it runs plus the headroom until the engine starts them.
    assert p.capacity([load(active=160, running=80)]) == 84


def test_requests_in_transit_count_as_not_started():
    # 40 sent requests are still being tokenized: vLLM's own waiting says 0.
    assert policy().capacity([load(active=140, running=100, waiting=0)]) == 104


def test_capacity_follows_the_replicas_that_exist():
    one = policy().capacity([load(active=230, running=230, waiting=10)])
    two = policy().capacity([load(active=230, running=230, waiting=10, name="a"),
                             load(active=230, running=230, waiting=10, name="b")])
    assert one == 234 and two == 2 * one


def test_the_upper_bound_holds_for_the_model():
    loads = [load(active=230, running=230, waiting=10)]
    assert policy().capacity(loads) == 234
    assert policy(bound=100).capacity(loads) == 100


def test_fixed_policy_is_per_live_replica():
    p = capacity_policy("fixed", headroom=4, kv_cache_high=0.9, fixed_per_replica=64,
                        upper_bound=None)
    assert p.capacity([load(name="a"), load(name="b")]) == 128


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


def test_admission_ranks_engine_priority_by_band_then_tenant_in_flight():
    async def main() -> None:
        a = AdmissionController(10, 100)
        heavy = [await a.acquire("heavy", "normal") for _ in range(5)]
        light = await a.acquire("light", "normal")
        high = await a.acquire("heavy", "high")
        assert high < light < heavy[1] < heavy[4] and light == heavy[0]
        a.release("heavy", 0)
        assert a.tenant_in_flight == {"heavy": 5, "light": 1}
        fifo = AdmissionController(10, 100, policy="fifo")
        assert {await fifo.acquire(t, "high") for t in "abc"} == {0}
    asyncio.run(main())


def test_engine_queue_holds_one_steps_worth_of_prompts():
    """Regression (H200 flood): a fixed queue of 4 let the engine start 4 prompts per step when
    its 8,192-token budget had room for 8 of 1,024 tokens."""
    r = EngineLoad(replica="r0", active=300, running=292, waiting=8, max_running=512, step_tokens=8192,
                    prefill_tokens_avg=1024.0)
    assert r.step_intake == 8
    p = policy()
    p.capacity([r])
    # 8 pending = what the next step starts; plus the headroom of 4.
    assert p.capacity([r]) == 292 + 8 + 4
    short = EngineLoad(replica="r1", active=100, running=100, waiting=0, max_running=512,
                        step_tokens=8192, prefill_tokens_avg=128.0)
    assert policy().capacity([short]) == 100 + 64 + 4
    # Cached prefixes: 1,024-token prompts of which 16 tokens need computing start 128 a step.
    cached = EngineLoad(replica="r2", active=300, running=292, waiting=20, max_running=512,
                         step_tokens=2048, prefill_tokens_avg=16.0)
    assert cached.step_intake == 128
    assert policy().capacity([cached]) == 292 + 128 + 4


def test_a_tenant_with_nothing_in_flight_gets_in_at_capacity():
    async def main() -> None:
        a = AdmissionController(2, 100, first_request_slots=1)
        await a.acquire("flood", "normal")
        flood_second = await a.acquire("flood", "normal")
        waiting = asyncio.ensure_future(a.acquire("flood", "normal"))
        await asyncio.sleep(0)
        assert a.queued() == 1
        quiet = await asyncio.wait_for(a.acquire("quiet", "normal"), 1)  # at once
        assert quiet < flood_second and a.in_flight == 3  # and first in the engine's queue
        # ... but only one request per idle tenant, and never past the extra slots.
        second = asyncio.ensure_future(a.acquire("quiet", "normal"))
        other = asyncio.ensure_future(a.acquire("other", "normal"))
        await asyncio.sleep(0)
        assert not second.done() and not other.done() and a.queued() == 3
        # Never ahead of a higher band that waits.
        high = asyncio.ensure_future(a.acquire("flood", "high"))
        await asyncio.sleep(0)
        a.release("flood", 0)  # in_flight 2: room for one more first request, but high waits
        idle = asyncio.ensure_future(a.acquire("idle", "low"))
        await asyncio.sleep(0)
        assert not idle.done() and not high.done() and a.in_flight == 2
        a.set_capacity(3)
        await asyncio.sleep(0)
        assert high.done() and not idle.done()
        idle.cancel()
        fifo = AdmissionController(2, 100, policy="fifo", first_request_slots=1)
        assert fifo.first_request_slots == 0
        for t in (waiting, second, other):
            t.cancel()
    asyncio.run(main())


def test_the_engine_never_holds_more_than_its_batch_plus_headroom():
    """Regression (CPU suite): a batch of 8 held 17 requests: one step's intake was counted on
    top of the free places, and the limit was relative to the router's in-flight count, which
    still held requests whose responses were being sent (their places counted twice)."""
    p = policy(headroom=2)
    r = EngineLoad(replica="r0", active=0, running=0, waiting=0, max_running=8, step_tokens=2048,
                    prefill_tokens_avg=2.0)
    p._steps["r0"] = (0, 8)  # the previous step had grown by a whole batch
    assert p.capacity([r]) == 8 + 2


def test_short_prompts_do_not_flood_a_full_batch():
    # 2,048-token steps and 5-token prompts: "one step's worth" would be 400 requests, but a
    # full batch starts only as many as finish; the engine queue stays at the headroom.
    r = EngineLoad(replica="r0", active=8, running=8, waiting=0, max_running=8, step_tokens=2048,
                    prefill_tokens_avg=5.0)
    assert policy().capacity([r]) == 8 + 4


def test_idle_tenant_gets_in_while_capacity_dips_below_in_flight_regression():
    """Regression (H200 flood): the engines drop a finished batch before the router has sent
    its responses, so capacity fell far below the router's in-flight count; a bypass bounded by
    `capacity + slots` refused the quiet tenant, which then waited a whole generation (8.5 s)."""
    async def main() -> None:
        a = AdmissionController(100, 1000, first_request_slots=2)
        for _ in range(100):
            await a.acquire("flood", "normal")
        waiting = asyncio.ensure_future(a.acquire("flood", "normal"))
        await asyncio.sleep(0)
        a.set_capacity(12)  # the batch finished in the engine; 100 responses still going out
        quiet = await asyncio.wait_for(a.acquire("quiet", "normal"), 1)
        other = await asyncio.wait_for(a.acquire("other", "normal"), 1)
        first = engine_priority("normal", 0)  # ahead of every flood request in the engine
        assert quiet == other == first and a.in_flight == 102
        third = asyncio.ensure_future(a.acquire("third", "normal"))  # the slots are bounded
        await asyncio.sleep(0)
        assert not third.done() and a.overdraft == {"quiet", "other"}
        a.release("quiet", 1)  # a first-request slot frees with its request
        assert a.overdraft == {"other"}
        assert await asyncio.wait_for(a.acquire("quiet", "normal"), 1) == first
        for t in (waiting, third):
            t.cancel()
    asyncio.run(main())


def test_the_config_names_exactly_the_registered_capacity_policies():
    """`router.admission.policy` is validated against a Literal; it must list the registry."""
    import typing

    from serve_app.admission import CAPACITY_POLICIES
    from serve_app.config import AdmissionSettings

    annotation = AdmissionSettings.model_fields["policy"].annotation
    assert set(typing.get_args(annotation)) == set(CAPACITY_POLICIES)


def test_capacity_stays_within_serves_limit_regression_quiet_tenant_waited_in_serves_queue():
    """Regression (CPU default, issue 42): max_num_seqs = max_ongoing_requests = 64, and a
    saturated engine's target (64 running + headroom) passed what Serve lets the replica take at
    once, less what the routers hold on it beside admitted requests (output channels, polls,
    idle tenants' first requests). The surplus waited in Serve's
    handle, first come first served with its retry backoff: a quiet tenant's first token took
    1.3 s beside a 96-way flood, 1.15 s of it in Serve's hop, while the router's fair queue,
    which would have put it first, held nothing of it."""
    def saturated(name, routers):
        return EngineLoad(64, 0, max_running=64, replica=name, active=64,
                          router_demand=tuple((f"router-{i}", 40) for i in range(routers)))

    p = EngineFeedbackCapacity(4, 0.95, None, serve_limit=64)
    # One router: its channel, a load poll and its 4 first-request slots are kept free.
    assert p.capacity([saturated("r0", 1)]) == 64 - 6
    # Two routers, two replicas: each replica keeps room for both routers' calls.
    assert p.capacity([saturated("r0", 2), saturated("r1", 2)]) == 2 * (64 - 12)
    # Below the limit the engine's own target stands (a batch of 8 plus headroom 4).
    small = EngineLoad(8, 0, max_running=8, replica="r2", active=8, router_demand=(("a", 8),))
    assert p.capacity([small]) == 12
    # A limit at the batch (the CPU default's shape): what is left of it, never none.
    assert EngineFeedbackCapacity(4, 0.95, None, serve_limit=8).capacity([small]) == 8 - 6
    assert EngineFeedbackCapacity(4, 0.95, None, serve_limit=4).capacity([small]) == 1
    # Without a limit (as before), and the registry passes the model's max_ongoing_requests.
    assert EngineFeedbackCapacity(4, 0.95, None).capacity([saturated("r3", 1)]) == 68
    registered = capacity_policy("engine_feedback", headroom=4, kv_cache_high=0.95,
                                 fixed_per_replica=64, upper_bound=None)
    assert registered.capacity([saturated("r4", 1)]) == 58


def test_a_full_batch_keeps_places_for_first_requests_regression_quiet_tenant_waited_in_the_engines_queue():
    """Regression (CPU default, issue 42, after Serve's limit was kept): with the batch
    (max_num_seqs 64) full and the headroom of the backlog waiting in the engine, a quiet
    tenant's first request waited there for places to free (132 ms p50, 224 ms to its first
    token; 42a). With ``batch_reserve`` (the CPU configs: 2) the backlog fills the batch less
    those places and nothing of it waits in the engine, so a first request the router lets in
    beyond capacity starts at the next step."""
    p = EngineFeedbackCapacity(4, 0.95, None, batch_reserve=2)
    assert p.capacity([load(active=62, running=62, max_running=64)]) == 62
    assert p.capacity([load(active=64, running=64, max_running=64)]) == 62
    # Off by default: the full batch plus the headroom waiting inside the engine.
    assert policy().capacity([load(active=64, running=64, max_running=64)]) == 68
    # A batch no larger than twice the reserve keeps none: 4 of 4.
    assert p.capacity([load(active=4, running=4, max_running=4)]) == 4 + 4
    # The router passes the config's value on, and the CPU default sets it.
    from serve_app.config import load_config

    cfg = load_config("deployments/local-cpu.yaml")
    assert cfg.router.admission.batch_reserve == 2
    registered = capacity_policy("engine_feedback", headroom=4, kv_cache_high=0.95,
                                 fixed_per_replica=96, upper_bound=None,
                                 batch_reserve=cfg.router.admission.batch_reserve)
    assert registered.capacity([load(active=64, running=64, max_running=64)]) == 62
