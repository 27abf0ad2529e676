"""A quiet tenant's request waits in the router's fair queue, never in Serve's (issue 42).

The CPU default had ``max_ongoing_requests`` = ``max_num_seqs`` = 64, and the router planned
each engine's load past that: a saturated engine's batch plus the headroom, plus the first
requests of idle tenants. What Serve would not let the replica take waited in Serve's handle,
first come first served with its retry backoff, so a quiet tenant beside a 96-way flood got
its first token after 1.3 s, 1.15 s of it in Serve's hop (bench/RESULTS.md 42a). Here the
same shape, small: a scripted-engine replica whose Serve limit is its batch.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from .conftest import HEADROOM, complete_recorded, sampled, start_scripted_app, wait_until

pytestmark = pytest.mark.integration

APP, PREFIX, MODEL = "serve-limit", "/serve-limit", "serve-limit"
BATCH = 4
STEP_S = 0.02
TOKENS = 25  # a flood request holds its place for 0.5 s
FLOOD = 3 * BATCH


@pytest.fixture(scope="module")
def limited(stack):
    """One scripted-engine replica with Serve's max_ongoing_requests at its batch."""
    from ray import serve

    from serve_app.app import llm_server_name

    base = start_scripted_app(stack, APP, PREFIX, MODEL, BATCH, STEP_S,
                              max_ongoing_requests=BATCH)
    router = serve.get_deployment_handle("Router", app_name=APP)
    server = serve.get_deployment_handle(llm_server_name(MODEL), app_name=APP)
    yield {"base": base, "keys": stack["keys"],
           "state": lambda: router.admission_state.remote().result(timeout_s=30)[MODEL],
           "started": lambda: server.engine_started_order.remote().result(timeout_s=30)}
    serve.delete(APP)


async def _complete(client: httpx.AsyncClient, s, tenant: str, ids: list) -> None:
    await complete_recorded(client, s["base"], MODEL, s["keys"][tenant], tenant, ids, TOKENS,
                            stream=True)


def test_a_quiet_request_waits_in_the_router_not_in_serve_regression_quiet_tenant_waited_in_serves_queue(limited):  # noqa: E501
    """team-a floods (three batches' worth); team-c then sends one request. Counted, not timed:
    the router never plans past what Serve lets the replica take (its limit less each router's
    channel, poll and first-request slots), and the engine starts team-c's request before any
    flood request that was still waiting. Checked against the build before the fix: the router
    planned up to 6 on a replica that Serve lets take 4 (one of them the router's channel), and
    this test failed on the count. The order held there too: Serve's handle retries each held
    request with its own backoff, so a newcomer often overtakes; on the CPU default a quiet
    request that lost those races waited up to the backoff's 1 s cap (42a)."""
    s = limited

    async def main() -> tuple[list, int]:
        ids: list = []
        async with httpx.AsyncClient(timeout=120) as client:
            flood = [asyncio.create_task(_complete(client, s, "team-a", ids))
                     for _ in range(FLOOD)]
            # A backlog: every flood request the router has not let out waits in it.
            await asyncio.to_thread(wait_until, lambda: s["state"]()["queued"] >= BATCH, 60)
            mark = len(await asyncio.to_thread(s["started"]))
            await _complete(client, s, "team-c", ids)
            await asyncio.gather(*flood)
        return ids, mark

    with sampled(s["state"]) as samples:
        ids, mark = asyncio.run(main())
    tenant_of = {rid: tenant for tenant, rid in ids}
    after = [tenant_of.get(rid) for rid in s["started"]()][mark:]
    assert after.count("team-c") == 1 and after.count("team-a") >= BATCH, after
    # At most a flood request admitted in the same moment starts first.
    assert after.index("team-c") <= 1, after
    # Serve's limit (BATCH) less one router's channel, poll and first-request slots leaves one
    # admitted request; team-c's first request goes beyond it (a slot of its own).
    busy = [x for x in samples if x["queued"] > 0]
    assert busy and max(x["capacity"] for x in busy) == 1, [x["capacity"] for x in busy]
    assert max(x["in_flight"] for x in busy) <= 1 + HEADROOM
