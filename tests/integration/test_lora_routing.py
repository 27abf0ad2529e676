"""Adapter placement on the real router and Serve (issue 39): a LoRA adapter's requests go to
the replica that reports it loaded, and past the load bound a second replica takes them (and
then reports it too), never a third (``routing.adapter_replicas`` 2: past the bound on both,
the requests wait on the less loaded of the two); once the burst is over they all go to the
first again.

Three replicas of the scripted engine (vLLM's batch and the adapters' LRU, no model: an adapter
loads at once and each replica reports what it holds, as the vLLM engine does), the suite's
router configuration and tenants, one adapter open to every tenant, routing policy
`power_of_two` (placement wraps it, and nothing else keys an adapter's requests). Which replica
served what is read from the router's own view (``admission_state``: each replica's
``requests_total`` and ``adapters``, as the engine feed reports them), waited on, never timed.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serve_app.launch import wait_until_serving

from .conftest import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.long]  # 50 s: the long tier

APP, PREFIX, MODEL, ADAPTER = "lora-routing", "/lora-routing", "scripted-lora", "tune-a"
BATCH = 4
MARGIN = 2  # routing.imbalance_margin: a replica takes a request while it holds <= 2 more
BURST = 12  # concurrent requests: more than one replica's bound from any one router
REPLICAS = 3  # one more than the adapter may sit on
TOKENS = 50  # a burst request holds its place 50 steps (1 s): the burst overlaps


@pytest.fixture(scope="module")
def app(stack):
    from ray import serve

    from serve_app.app import build_app
    from serve_app.config import AdapterSettings, AutoscalingSettings, LoraSettings, ModelSettings
    from serve_app.config.routing import RoutingSettings
    from serve_app.engine.scripted import SCRIPTED_ENGINE_CLASS

    model = ModelSettings(
        name=MODEL, path=str(stack["path"]), device="cpu", max_model_len=2048,
        autoscaling=AutoscalingSettings(min_replicas=REPLICAS, max_replicas=REPLICAS),
        lora=LoraSettings(max_loras=1, max_lora_rank=8),
        adapters=[AdapterSettings(name=ADAPTER, path="org/tune-a", owners=["public"])],
        # power_of_two for the base model's requests (no prefix index to confound which
        # replica an adapter's requests find) and placement, which wraps every policy.
        routing=RoutingSettings(policy="power_of_two", imbalance_margin=MARGIN),
        engine_kwargs={"max_num_seqs": BATCH, "scripted_step_s": 0.02})
    serve.run(build_app(stack["config"].model_copy(update={"models": [model]}),
                        SCRIPTED_ENGINE_CLASS), name=APP, route_prefix=PREFIX, blocking=False)
    base = stack["base"] + PREFIX
    wait_until_serving(base, timeout_s=120, interval_s=0.2)
    router = serve.get_deployment_handle("Router", app_name=APP)

    def replicas() -> dict[str, dict]:
        state = router.admission_state.remote().result(timeout_s=30)[MODEL]
        return {r["replica"]: r for r in state["per_replica"]}

    def send(max_tokens: int = 2, model: str = ADAPTER) -> int:
        return httpx.post(f"{base}/v1/completions", headers=stack["headers"], timeout=120,
                          json={"model": model, "prompt": "hi",
                                "max_tokens": max_tokens}).status_code

    # One base request, and a view that counts it: the feed has polled since /ready started
    # it, and a view from before the request made the test's "before" snapshot miss it
    # (regression: 6 sequential requests read as 7, one on another replica).
    assert send(model=MODEL) == 200

    def counted() -> bool:
        view = replicas()
        return len(view) == REPLICAS and sum(r["requests_total"] for r in view.values()) >= 1

    try:
        wait_until(counted, 60, 0.1)
    except AssertionError:  # say what Serve sees of the model's replicas
        raise AssertionError(f"{REPLICAS} replicas not in the router's view: {replicas()}; "
                             f"{serve.status().applications[APP]}") from None
    yield {"replicas": replicas, "send": send}
    serve.delete(APP)


def _served(before: dict[str, dict], after: dict[str, dict]) -> dict[str, int]:
    return {rid: after[rid]["requests_total"] - before[rid]["requests_total"] for rid in after}


def _settled(s, total: int, before: dict[str, dict]) -> dict[str, dict] | None:
    """The router's view once it counts ``total`` requests more than ``before``."""
    now = s["replicas"]()
    return now if sum(_served(before, now).values()) >= total else None


def test_an_adapters_requests_follow_its_replica_and_spill_past_the_bound(app):
    s = app
    start = s["replicas"]()
    assert all(not r["adapters"] for r in start.values())

    # One at a time: all on one replica, which then reports the adapter loaded.
    for _ in range(6):
        assert s["send"]() == 200
    quiet = wait_until(lambda: _settled(s, 6, start), 30, 0.05)
    served = _served(start, quiet)
    home = max(served, key=served.__getitem__)
    others = [rid for rid in served if rid != home]
    assert served == {home: 6, **{rid: 0 for rid in others}}, served
    wait_until(lambda: s["replicas"]()[home]["adapters"] == [ADAPTER], 30, 0.05)
    assert all(s["replicas"]()[rid]["adapters"] == [] for rid in others)

    # A burst: past its bound the home replica's overflow goes to a second replica, which
    # loads it; past the bound on both, the rest wait on them: the third is never sent one.
    with ThreadPoolExecutor(BURST) as pool:
        statuses = list(pool.map(lambda _: s["send"](TOKENS), range(BURST)))
    assert statuses == [200] * BURST
    burst = wait_until(lambda: _settled(s, BURST, quiet), 30, 0.05)
    spread = _served(quiet, burst)
    second = max(others, key=spread.__getitem__)
    third = next(rid for rid in others if rid != second)
    assert spread[home] > MARGIN and spread[second] > 0 and spread[third] == 0, spread
    wait_until(lambda: s["replicas"]()[second]["adapters"] == [ADAPTER], 30, 0.05)
    assert s["replicas"]()[third]["adapters"] == []

    # The burst over (the view counts no request on any replica), two hold it; one at a
    # time they all go to the first holder again (the other's LRU would drop it as other
    # adapters come).
    wait_until(lambda: all(r["active"] == 0 and r["running"] + r["waiting"] == 0
                           for r in s["replicas"]().values()), 30, 0.05)
    for _ in range(6):
        assert s["send"]() == 200
    after = wait_until(lambda: _settled(s, 6, burst), 30, 0.05)
    assert _served(burst, after) == {home: 6, second: 0, third: 0}, _served(burst, after)
    print(f"\nsequential on {home[-6:]}: 6 + 6; burst of {BURST}: {spread}")
