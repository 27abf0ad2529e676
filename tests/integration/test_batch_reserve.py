"""``router.admission.batch_reserve``: the backlog leaves places of a full batch free, so an
idle tenant's first request starts at the engine's next step (issue 42).

Without it a flood fills the engine's batch and its headroom waits in the engine's queue; a
quiet tenant's request, let in beyond capacity by its first-request slot and put ahead of the
queued flood by its engine priority, still waits for a running request to end (the CPU
default: 132 ms p50 in vLLM's queue, 224 ms to the first token; with 2 places kept, 32 ms;
bench/RESULTS.md 42a). Here the same shape on one scripted-engine replica, counted rather than
timed: the flood's requests run 100 steps each and all start within the first few steps, so
whether the quiet request waited for a place shows as whether a flood request was answered
before it.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from .conftest import complete_recorded, sampled, start_scripted_app, wait_until

pytestmark = pytest.mark.integration

APP, PREFIX, MODEL = "batch-reserve", "/batch-reserve", "batch-reserve"
BATCH = 8
RESERVE = 2
STEP_S = 0.02
FLOOD_TOKENS = 100  # a flood request holds its place for 2 s
QUIET_TOKENS = 4
FLOOD = 2 * BATCH


@pytest.fixture(scope="module")
def reserved(stack):
    """One scripted-engine replica behind routers that keep RESERVE places of its batch."""
    from ray import serve

    base = start_scripted_app(stack, APP, PREFIX, MODEL, BATCH, STEP_S, batch_reserve=RESERVE)
    router = serve.get_deployment_handle("Router", app_name=APP)
    yield {"base": base, "keys": stack["keys"],
           "state": lambda: router.admission_state.remote().result(timeout_s=30)[MODEL]}
    serve.delete(APP)


def test_a_quiet_tenants_first_request_starts_beside_a_full_backlog_regression_waited_for_a_place(reserved):  # noqa: E501
    """team-a floods (two batches' worth, 2 s each); once the backlog waits in the router,
    team-c sends one short request. It is answered before any flood request, so it started in
    a kept place rather than after a running request ended, and while the backlog waited the
    engine held (running and waiting) at most BATCH - RESERVE of it. Checked against
    batch_reserve 0: the engine ran its full batch with the headroom waiting, and team-c was
    answered after every flood request that was running when it came."""
    s = reserved

    async def main() -> list:
        ids: list = []
        async with httpx.AsyncClient(timeout=120) as client:
            flood = [asyncio.create_task(complete_recorded(
                client, s["base"], MODEL, s["keys"]["team-a"], "team-a", ids, FLOOD_TOKENS))
                for _ in range(FLOOD)]
            # The backlog waits in the router and the engine runs all the router lets it.
            await asyncio.to_thread(wait_until, lambda: (x := s["state"]())["queued"] >= BATCH // 2
                                    and x["engine_running"] >= BATCH - RESERVE, 60, 0.02)
            await complete_recorded(client, s["base"], MODEL, s["keys"]["team-c"], "team-c",
                                    ids, QUIET_TOKENS)
            await asyncio.gather(*flood)
        return ids

    with sampled(s["state"]) as samples:
        ids = asyncio.run(main())
    tenants = [tenant for tenant, _ in ids]
    assert tenants.count("team-a") == FLOOD and tenants[0] == "team-c", tenants
    backlog = [x for x in samples if x["queued"] > 0]
    assert backlog and max(x["capacity"] for x in backlog) == BATCH - RESERVE, \
        [x["capacity"] for x in backlog]
    # The feed's counts (the replica's running and waiting as its engine reported them): the
    # backlog never filled the batch (only the quiet request went beyond it).
    held = [x["engine_running"] + x["engine_waiting"] for x in backlog]
    assert max(held) <= BATCH - RESERVE + 1, held
