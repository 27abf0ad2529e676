"""Issue 37's governance acceptance checks through HTTP, on an app of two router replicas in
front of the scripted engine (the governance is the routers' business: no model needed).

- A tenant held back by its ``max_concurrent_requests`` with a hundred requests waiting does not
  lock its priority band: another tenant of the band gets every request in, and the capped
  tenant's excess is refused by its own bound (``router.max_queued_per_tenant``).
- A token budget bounds what concurrent requests spend: 40 requests at once against a budget of
  2,000 tokens spend at most the budget plus one request, the rest get ``insufficient_quota``.

Each router replica is reached on its own port, so both take their half of every burst.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from .conftest import wait_until
from .test_cluster_quota import start_two_router_app

pytestmark = pytest.mark.integration

APP = "gov-http"
PREFIX = "/gov-http"
MODEL = "scripted-gov-http"
# The lockout test: a tenant capped at 2 and another tenant of the same (normal) band.
CAPPED, OTHER, CAP = "lockout-capped", "lockout-other", 2
# Each router replica's bounds: the capped tenant's backlog alone fills the band (PER_BAND),
# the state in which the band locked out, and its own bound (PER_TENANT) refuses the rest.
PER_BAND = PER_TENANT = 50
# The capped tenant's requests per router replica: two run, PER_TENANT wait, the rest are
# refused by its own bound.
CAPPED_PER_ROUTER = 60
# The budget test's tenant and load.
BUDGETED, BUDGET, BURST, MAX_TOKENS = "budget-2000", 2000, 40, 64


@pytest.fixture(scope="module")
def gov_app(stack) -> dict[str, Any]:
    """The two-router app of this module: its tenants' keys and the routers' own ports."""
    from ray import serve

    from serve_app.config import TenantSettings
    from serve_app.config.app import TokenBudget
    from serve_app.governance.keys import key_digest, new_key

    keys = {name: new_key() for name in (CAPPED, OTHER, BUDGETED)}
    limits: dict[str, dict[str, Any]] = {
        CAPPED: {"max_concurrent_requests": CAP}, OTHER: {},
        BUDGETED: {"token_budget": TokenBudget(tokens=BUDGET, period="day")}}
    tenants = [TenantSettings(name=n, api_key_sha256=[key_digest(keys[n])], **limits[n])
               for n in keys]
    ports = start_two_router_app(stack, APP, PREFIX, MODEL, tenants, router={
        "max_queued_per_band": PER_BAND, "max_queued_per_tenant": PER_TENANT})
    yield {"keys": keys, "ports": ports, "tenants": tenants}
    serve.delete(APP)


def _url(port: int) -> str:
    return f"http://127.0.0.1:{port}{PREFIX}/v1/completions"


async def _post(client: httpx.AsyncClient, port: int, key: str, max_tokens: int
                ) -> httpx.Response:
    return await client.post(_url(port), headers={"Authorization": f"Bearer {key}"}, json={
        "model": MODEL, "prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True})


def _queued_everywhere() -> int:
    """Requests still queued or in flight in any of this app's router replicas, as seen by a few
    calls to the Router deployment (each goes to one replica)."""
    from ray import serve

    router = serve.get_deployment_handle("Router", app_name=APP)
    states = [router.admission_state.remote().result(timeout_s=30)[MODEL] for _ in range(6)]
    return sum(s["queued"] + s["in_flight"] for s in states)


def test_a_capped_tenants_backlog_leaves_its_band_open_regression_band_lockout(gov_app):
    """`lockout-capped` (max_concurrent_requests 2) sends 60 long requests to each router
    replica: 2 run in all, 50 wait in each router (100 in all: its own bound, and the band's:
    its backlog alone fills the band), and the rest get 429 `queue_full` naming its own
    waiting requests. Meanwhile `lockout-other`, same band, sends 10 short requests to each
    router: every one is 200 (when a full band refused every tenant in it, all 20 got 429)."""
    keys, ports = gov_app["keys"], gov_app["ports"]
    refused_at = 2 * CAPPED_PER_ROUTER - 2 * PER_TENANT - CAP  # once both routers are full

    async def main() -> tuple[list[httpx.Response], list[httpx.Response], int]:
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            # ~10 s each on the engine (2000 steps of 5 ms): the backlog stays for the test.
            capped = [asyncio.create_task(_post(client, port, keys[CAPPED], 2000))
                      for port in ports for _ in range(CAPPED_PER_ROUTER)]

            def refused() -> list[httpx.Response]:
                return [t.result() for t in capped if t.done() and not t.exception()]

            deadline = asyncio.get_running_loop().time() + 60
            while len(refused()) < refused_at:  # both routers hold the bound's 50 waiting
                assert asyncio.get_running_loop().time() < deadline, len(refused())
                await asyncio.sleep(0.05)
            waiting = 2 * CAPPED_PER_ROUTER - len(refused())
            other = await asyncio.gather(*[_post(client, port, keys[OTHER], 4)
                                           for port in ports for _ in range(10)])
            done = refused()
            for task in capped:  # the capped clients leave: their requests are dropped
                task.cancel()
            await asyncio.gather(*capped, return_exceptions=True)
            return other, done, waiting

    other, capped_done, waiting = asyncio.run(main())
    print(f"\n{CAPPED}: {waiting} running or waiting, {len(capped_done)} refused; "
          f"{OTHER}: {[r.status_code for r in other]}")
    assert [r.status_code for r in other] == [200] * 20, [
        (r.status_code, r.text[:200]) for r in other if r.status_code != 200]
    # Refused: all but the 2 x 50 waiting and the (at most CAP) running.
    assert refused_at <= len(capped_done) <= refused_at + CAP, len(capped_done)
    for r in capped_done:
        assert r.status_code == 429, r.text
        error = r.json()["error"]
        assert error["code"] == "queue_full", error
        assert f"{PER_TENANT} of your requests waiting" in error["message"], error
    # The capped tenant's clients left: the routers drop their backlog.
    wait_until(lambda: _queued_everywhere() == 0, 60, 0.2)


def test_a_2000_token_budget_holds_40_concurrent_requests_regression_budgets_bound_nothing_under_concurrency(  # noqa: E501
        gov_app):
    """`budget-2000` (2,000 tokens a day) sends 40 requests of max_tokens 64 at once, 20 to
    each router replica. The tokens its answered requests used (their `usage`, and the spend
    the routers recorded in the budget store, which `serve-app status` shows) are at most the
    budget plus one request (prompt + 64); every refused request is 429 `insufficient_quota`.
    (Before reservations, every request started together was admitted: 40 x 65 tokens.)"""
    from serve_app.governance.budgets import budget_report

    key, ports = gov_app["keys"][BUDGETED], gov_app["ports"]

    async def main() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*[_post(client, ports[i % 2], key, MAX_TOKENS)
                                          for i in range(BURST)])

    answers = asyncio.run(main())
    ok = [r for r in answers if r.status_code == 200]
    refused = [r for r in answers if r.status_code != 200]
    used = sum(r.json()["usage"]["total_tokens"] for r in ok)
    one_request = ok[0].json()["usage"]["prompt_tokens"] + MAX_TOKENS if ok else MAX_TOKENS
    for r in refused:
        assert r.status_code == 429, r.text
        error = r.json()["error"]
        assert error["code"] == "insufficient_quota", error
        assert error["type"] == "insufficient_quota", error
    # The routers write their spend to the store every second: wait until it holds every
    # answered request's tokens (it must equal them: nothing refused was charged).
    budgeted = [t for t in gov_app["tenants"] if t.name == BUDGETED]
    report = wait_until(lambda: (b := budget_report(APP, budgeted)[BUDGETED])
                        and b["spent"] >= used and b, 15, 0.2)
    print(f"\n{BUDGETED}: {len(ok)} answered, {len(refused)} refused; {used} tokens used "
          f"(store: {report['spent']}) against a budget of {BUDGET} + one request "
          f"({one_request})")
    assert report["spent"] == used, (report, used)
    assert used <= BUDGET + one_request, (used, len(ok))
    assert refused, "40 x 65 tokens fit a budget of 2000?"
