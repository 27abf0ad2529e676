"""Prefix-affinity routing on real vLLM CPU engines: two replicas of the tiny model behind the
real router, HAProxy and Serve, the model's ``routing.policy: prefix_affinity``.

A tenant's requests that share a prefix land on one replica, the one rendezvous hashing of
(tenant salt, prefix) names; another tenant sending the same prompt lands on its own replica,
which can be the other one. Which replica served a request is read from the replicas' request
counters (``requests_total``, as `serve-app status` shows them), one request at a time."""

from __future__ import annotations

import httpx
import pytest

from serve_app.engine.protocol import GenerationRequest, SamplingOptions
from serve_app.routing.prefix_affinity import rendezvous_order
from serve_app.routing.prefix_key import PrefixKeyer
from serve_app.tenancy.keys import Tenant

from .conftest import wait_until

pytestmark = pytest.mark.integration

APP = "affinity"
PREFIX = "/affinity"
MODEL = "tiny-affinity"
# Keys cover the first 4 x 16 x 4 = 256 characters of a prompt.
KEYER = PrefixKeyer(block_tokens=16, prefix_blocks=4, chars_per_token=4)
# Tenants of the shared stack without limits (and without usage records other tests count).
TENANTS = ("team-a", "team-b", "team-c")
PER_TENANT = 6


def _system_prompt(n: int) -> str:
    return (f"System prompt {n}: you answer questions about the handbook of team {n}. " * 8)[:300]


@pytest.fixture(scope="module")
def affinity(stack):
    from ray import serve

    from serve_app.app import build_app
    from serve_app.config import AutoscalingSettings, ModelSettings
    from serve_app.config.routing import RoutingSettings

    base = stack["config"].models[0]
    model = ModelSettings(
        name=MODEL, path=str(stack["path"]), device="cpu", max_model_len=1024,
        engine_kwargs={**base.engine_kwargs, "max_num_seqs": 4}, engine_env=base.engine_env,
        autoscaling=AutoscalingSettings(min_replicas=2, max_replicas=2),
        routing=RoutingSettings(policy="prefix_affinity", block_tokens=KEYER.block_tokens,
                                prefix_blocks=KEYER.prefix_blocks,
                                chars_per_token=KEYER.chars_per_token))
    serve.run(build_app(stack["config"].model_copy(update={"models": [model]})),
              name=APP, route_prefix=PREFIX, blocking=False)
    router = serve.get_deployment_handle("Router", app_name=APP)

    def replicas() -> dict[str, int]:
        """Replica id -> requests it has taken, as the router's engine feed last saw them."""
        state = router.admission_state.remote().result(timeout_s=30)[MODEL]
        return {r["replica"]: r["requests_total"] for r in state["per_replica"]}

    def send(tenant: str, **body: object) -> str:
        """Send one request as ``tenant``; the id of the replica that took it."""
        before = replicas()
        r = httpx.post(f"{stack['base']}{PREFIX}/v1/{'chat/' if 'messages' in body else ''}"
                       "completions", timeout=120,
                       headers={"Authorization": f"Bearer {stack['keys'][tenant]}"},
                       json={"model": MODEL, "max_tokens": 2, **body})
        assert r.status_code == 200, r.text
        after = wait_until(lambda: (x := replicas()) and sum(x.values()) > sum(
            before.values()) and x, 30)
        (served,) = [rid for rid, n in after.items() if n > before.get(rid, 0)]
        return served

    last: list[object] = []

    def ready() -> bool:
        try:
            seen = replicas()
            r = httpx.post(f"{stack['base']}{PREFIX}/v1/completions", timeout=60,
                           headers=stack["headers"],
                           json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
            last[:] = [seen, r.status_code, r.text[:300]]
            return len(seen) == 2 and r.status_code == 200
        except (httpx.HTTPError, KeyError) as err:
            last[:] = [repr(err)]
            return False

    try:
        wait_until(ready, 240, 0.5)
    except AssertionError:
        raise AssertionError(f"the two-replica app is not ready: {last}") from None
    yield {"send": send, "replicas": replicas}
    serve.delete(APP)


def _predicted(tenant: str, replica_ids: list[str], **prompt: object) -> str:
    request = GenerationRequest("r", SamplingOptions(), cache_salt=Tenant(tenant).cache_salt,
                                **prompt)  # type: ignore[arg-type]
    key = KEYER.key(request)
    assert key is not None
    return rendezvous_order(key, replica_ids)[0]


def test_a_tenants_shared_prefix_stays_on_one_replica(affinity):
    ids = sorted(affinity["replicas"]())
    prompt = _system_prompt(1)
    served = {affinity["send"]("team-a", prompt=f"{prompt} Question {i}: why?")
              for i in range(PER_TENANT)}
    assert served == {_predicted("team-a", ids, prompt=prompt)}
    # Chat: keyed on the messages' text, so a conversation's later turns follow its first.
    system = {"role": "system", "content": prompt}
    chats = {affinity["send"]("team-a", messages=[system, {"role": "user", "content": q}])
             for q in ("first question", "a second, longer question", "third")}
    assert chats == {_predicted("team-a", ids, messages=[system])}


def test_another_tenant_with_the_same_prompt_goes_where_its_own_salt_says(affinity):
    """The salt is part of the key: tenants sending the identical prompt are placed apart
    (vLLM would not share their cache anyway). The prompt is picked so that two tenants'
    keys name different replicas; each lands on its own."""
    ids = sorted(affinity["replicas"]())
    prompt = next(p for p in (_system_prompt(n) for n in range(2, 40))
                  if len({_predicted(t, ids, prompt=p) for t in TENANTS}) == 2)
    served = {t: {affinity["send"](t, prompt=f"{prompt} Q{i}") for i in range(3)}
              for t in TENANTS}
    assert served == {t: {_predicted(t, ids, prompt=prompt)} for t in TENANTS}
    assert len(set().union(*served.values())) == 2
