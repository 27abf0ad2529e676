"""Ordering and race tests of the real router on Ray Serve, with the scripted engine behind it.

The router, Serve, HAProxy and the admission feed are the real ones; the engine is
:class:`serve_app.engine.scripted.ScriptedEngine` (vLLM's batch limit and priority-ordered
waiting queue, one step every 20 ms, no model), so a batch frees its places on a fixed beat and
the order in which the engine started requests is recorded exactly. The real-engine versions of
these behaviours stay in test_fair_queue.py.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from .conftest import HEADROOM, complete_recorded, sampled, start_scripted_app, wait_until

pytestmark = pytest.mark.integration

APP = "scripted"
PREFIX = "/scripted"
MODEL = "scripted"
BATCH = 4
STEP_S = 0.02
TOKENS = 50  # one request holds a batch place for TOKENS steps (1 s): a place frees about
# every TOKENS x STEP_S / BATCH = 0.25 s under the flood, far apart from the late arrivals
FLOOD_TOKENS = 200  # the priority test's flood: a place every second


@pytest.fixture(scope="module")
def scripted(stack):
    """The stack's router configuration and tenants in front of one scripted-engine replica."""
    from ray import serve

    from serve_app.app import llm_server_name

    base = start_scripted_app(stack, APP, PREFIX, MODEL, BATCH, STEP_S)
    router = serve.get_deployment_handle("Router", app_name=APP)
    server = serve.get_deployment_handle(llm_server_name(MODEL), app_name=APP)

    def state() -> dict:
        return router.admission_state.remote().result(timeout_s=30)[MODEL]

    yield {"base": base, "state": state, "keys": stack["keys"],
           "started": lambda: server.engine_started_order.remote().result(timeout_s=30),
           "load": lambda: server.engine_load.remote().result(timeout_s=30),
           "hold": lambda held: server.engine_hold_steps.remote(held).result(timeout_s=30)}
    serve.delete(APP)


async def _complete(client: httpx.AsyncClient, s, tenant: str, ids: list, stream: bool = False,
                    max_tokens: int = TOKENS) -> None:
    """One completion as ``tenant``; appends (tenant, request id) once it is answered."""
    await complete_recorded(client, s["base"], MODEL, s["keys"][tenant], tenant, ids,
                            max_tokens, stream)


# team-c's late requests: more than the places that flood requests ending in the engine's last
# step before the hold can free. The fair queue gives a newly backlogged tenant the next place,
# so with three a full run once saw all of team-c's let in and none waiting to be overtaken.
C_LATE = 6


@pytest.mark.long  # 30 s; make test keeps the bands' order on the vLLM engine
# (test_fair_queue.py::test_high_priority_goes_before_every_waiting_normal_request)
def test_high_priority_starts_before_every_waiting_normal_request(scripted):
    """team-a floods; then team-c (normal) sends six requests and team-b (high) three, in that
    order. The engine starts all of team-b's before team-c's waiting ones (team-c's first goes
    in at once: a tenant with nothing in flight), and before the flood's backlog. Which of
    team-c's wait is read from the router once they have arrived (a full-suite run saw
    team-c's second let into the engine's queue before team-b's came).
    Checked against a build without bands (team-b made normal): team-c's second request then
    started before team-b's second, and this test failed.
    Regression (flaky_arrival_race): the late ones used to be sent between two freed places, a
    second apart; on a loaded machine team-b's third once reached the router after team-c's
    second had taken a place (arrival order, not the bands). Now the engine's step loop is held
    while they arrive, so no place frees until all of them wait in the router."""
    s = scripted

    def held_total() -> int:  # requests the router holds: admitted (in the engine) or queued
        x = s["state"]()
        return x["in_flight"] + x["queued"]

    async def main() -> tuple[list, int]:
        ids: list = []
        async with httpx.AsyncClient(timeout=120) as client:
            flood = [asyncio.create_task(_complete(client, s, "team-a", ids,
                                                   max_tokens=FLOOD_TOKENS))
                     for _ in range(6 * BATCH)]
            # A backlog in the router: the batch, the engine's small queue and team-a's first
            # request are out, the rest waits.
            await asyncio.to_thread(
                wait_until, lambda: (x := s["state"]())["queued"] >= 3 * BATCH and x, 60)
            # Every flood request has reached the router (or been answered), so that once the
            # engine is held the router's count moves only by the late arrivals.
            await asyncio.to_thread(
                wait_until, lambda: held_total() + sum(t.done() for t in flood) >= 6 * BATCH, 60)
            await asyncio.to_thread(s["hold"], True)
            try:
                before = await asyncio.to_thread(held_total)
                engine_waiting = (await asyncio.to_thread(s["state"]))["engine_waiting"]
                late = []
                for tenant in ["team-c"] * C_LATE:
                    late.append(asyncio.create_task(_complete(client, s, tenant, ids)))
                    await asyncio.sleep(0.001)  # keeps the arrival order
                await asyncio.to_thread(wait_until, lambda: held_total() == before + C_LATE, 60,
                                        0.02)
                # team-c's requests that wait in the router when team-b's arrive (its first
                # goes in at once): all of them are held by the router, admitted or queued; read
                # once the engine feed has seen the admitted ones in the engine's queue (a poll
                # after them, which is when the router could have let in another).
                def c_seen() -> tuple[int] | None:
                    x = s["state"]()
                    out = x["in_flight_by_tenant"].get("team-c", 0)
                    return (out,) if x["engine_waiting"] >= engine_waiting + out else None

                c_waiting = C_LATE - (await asyncio.to_thread(wait_until, c_seen, 60, 0.02))[0]
                for tenant in ["team-b"] * 3:
                    late.append(asyncio.create_task(_complete(client, s, tenant, ids)))
                    await asyncio.sleep(0.001)
                await asyncio.to_thread(wait_until,
                                        lambda: held_total() == before + C_LATE + 3, 60, 0.02)
                mark = len(await asyncio.to_thread(s["started"]))
            finally:  # a held engine would stall the module's later tests
                await asyncio.to_thread(s["hold"], False)
            await asyncio.gather(*flood, *late)
        return ids, mark, c_waiting

    with sampled(s["state"], every_s=0.05) as samples:
        ids, mark, c_waiting = asyncio.run(main())
    tenant_of = {rid: tenant for tenant, rid in ids}
    order = [tenant_of.get(rid) for rid in s["started"]()]
    after = order[mark:]  # what started once the late tenants began to arrive
    b_last = max(i for i, t in enumerate(after) if t == "team-b")
    c_positions = [i for i, t in enumerate(after) if t == "team-c"]
    # Every team-c request that waited in the router when team-b's arrived starts after all of
    # team-b's. Those the router had let into the engine's queue before (its first, and on a
    # loaded machine once a second, when the engine's load report lagged) are not waiting.
    assert c_waiting >= 1, "team-c's later requests did not wait: nothing to overtake"
    first_waiting = C_LATE - c_waiting
    assert len(c_positions) == C_LATE and b_last < c_positions[first_waiting], (after, c_waiting)
    # The flood's backlog waits for team-b too; only what the engine already held (its queue of
    # HEADROOM) or had in transit may start in between.
    flood_between = sum(1 for t in after[:b_last] if t == "team-a")
    assert flood_between <= 2 * HEADROOM, after
    # The backlog waited in the router, not in the engine: the engine holds what its batch
    # runs plus at most the headroom and the idle tenants' first requests.
    busy = [x for x in samples if x["queued"] > 0]
    assert busy and max(x["engine_running"] for x in busy) <= BATCH
    held = sorted(x["engine_running"] + x["engine_waiting"] for x in busy)
    assert held[-1] <= BATCH + 2 * HEADROOM, held


def test_requests_cancelled_at_any_moment_leave_no_slot_behind(scripted):
    """Sixty requests (half streamed) against a full batch, each abandoned by its client at a
    random moment: before admission, while queued, in the first step, mid-stream or just as it
    ends. Afterwards the router holds nothing and the engine runs nothing; a single leaked slot
    shows as in_flight == 1 (and would throttle the model for good)."""
    s = scripted
    rng = random.Random(7)

    async def abandon(client: httpx.AsyncClient, tenant: str, stream: bool, after_s: float):
        task = asyncio.create_task(_complete(client, s, tenant, [], stream=stream,
                                             max_tokens=15))
        await asyncio.sleep(after_s)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def main() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            await asyncio.gather(*[
                abandon(client, rng.choice(["team-a", "team-c"]), i % 2 == 0,
                        rng.uniform(0.0, 1.5)) for i in range(60)])

    asyncio.run(main())
    state = wait_until(lambda: (x := s["state"]())["in_flight"] == 0 and x["queued"] == 0
                       and x, 30)
    load = wait_until(lambda: (x := s["load"]()).unfinished == 0 and x.active == 0
                      and x, 30)
    assert state["capacity"] >= BATCH and load.running == 0
    # And the model still serves.
    ids: list = []

    async def one() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            await _complete(client, s, "team-a", ids, stream=True, max_tokens=3)

    asyncio.run(one())
    assert len(ids) == 1


def test_fair_share_after_a_quiet_spell_alternates_regression_idle_tenant_went_first(scripted):
    """team-a is served alone below capacity for a while (its requests never wait), then team-a
    and team-c are both backlogged. Service alternates within about one request. The fair
    queue's clock used to move only when a queued request was popped: team-a's unqueued service
    left it at 0, so team-c (idle meanwhile) then went first for as long as team-a's whole past
    service (the unit test through the admission controller,
    test_tenant_served_below_capacity_moves_the_clock_regression_idle_tenant_went_first, fails
    without the fix)."""
    s = scripted

    async def main() -> tuple[list, int]:
        ids: list = []
        async with httpx.AsyncClient(timeout=120) as client:
            async def alone() -> None:  # one request at a time: never queued
                for _ in range(8):
                    await _complete(client, s, "team-a", ids, max_tokens=10)

            await asyncio.gather(*[alone() for _ in range(2)])
            assert (await asyncio.to_thread(s["state"]))["queued"] == 0
            mark = len(await asyncio.to_thread(s["started"]))
            both = []
            for i in range(24):  # interleaved arrivals, 12 each
                tenant = "team-a" if i % 2 else "team-c"
                both.append(asyncio.create_task(_complete(client, s, tenant, ids)))
                await asyncio.sleep(0.001)  # keeps the arrival order
            await asyncio.gather(*both)
        return ids, mark

    ids, mark = asyncio.run(main())
    tenant_of = {rid: tenant for tenant, rid in ids}
    after = [tenant_of.get(rid) for rid in s["started"]()][mark:]
    assert sorted(after) == ["team-a"] * 12 + ["team-c"] * 12, after
    # What went in before a queue formed (the batch, the engine's headroom, the first-request
    # slots) came in arrival order; from then on the two tenants alternate.
    queued_part = after[BATCH + 2 * HEADROOM:]
    lead = worst = 0
    for tenant in queued_part:
        lead += 1 if tenant == "team-c" else -1
        worst = max(worst, abs(lead))
    assert worst <= 2, after
