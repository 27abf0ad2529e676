"""Prefix-affinity routing on real vLLM CPU engines: two replicas of the tiny model behind two
router replicas (HAProxy spreads the requests over them) and Serve, the model's
``routing.policy: prefix_affinity``.

A tenant's requests that share a prefix land on one replica, the one rendezvous hashing of
(tenant salt, prefix) names, whichever router takes them; another tenant sending the same
prompt lands on its own replica, which can be the other one; a tenant that floods its replica
spills to the other. Which replica served a request is read from the replicas' request counters
(``requests_total``, as `serve-app status` shows them), one request at a time."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serve_app.engine.protocol import GenerationRequest, SamplingOptions
from serve_app.routing.prefix_affinity import rendezvous_order
from serve_app.routing.prefix_key import PrefixKeyer
from serve_app.governance.keys import Tenant

from .conftest import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.long]  # `make test-long`

APP = "affinity"
PREFIX = "/affinity"
MODEL = "tiny-affinity"
# Keys cover the first 4 x 16 x 4 = 256 characters of a prompt.
KEYER = PrefixKeyer(block_tokens=16, prefix_blocks=4, chars_per_token=4)
# Tenants of the shared stack without limits (and without usage records other tests count).
TENANTS = ("team-a", "team-b", "team-c")
PER_TENANT = 6
MARGIN = 2  # routing.imbalance_margin
FEED_POLL_S = 0.05  # the routers' engine-feed poll period, busy or idle


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
                                chars_per_token=KEYER.chars_per_token,
                                imbalance_margin=MARGIN))
    cfg = stack["config"]
    # Two routers: each computes the same replica for a key, with no state shared. Their engine
    # feeds poll fast while idle too, so a view of the replicas' counts is never old for long.
    routers = cfg.router.model_copy(update={"num_replicas": 2, "admission": (
        cfg.router.admission.model_copy(update={"idle_poll_interval_s": FEED_POLL_S}))})
    cfg = cfg.model_copy(update={"models": [model], "router": routers})
    serve.run(build_app(cfg), name=APP, route_prefix=PREFIX, blocking=False)
    router = serve.get_deployment_handle("Router", app_name=APP)

    def replicas() -> dict[str, int]:
        """Replica id -> requests it has taken, as one router's engine feed last saw them ({}
        from a router whose feed has not started: it starts with the router's first request)."""
        state = router.admission_state.remote().result(timeout_s=30)[MODEL]
        return {r["replica"]: r["requests_total"] for r in state["per_replica"]}

    def post(tenant: str, **body: object) -> httpx.Response:
        return httpx.post(f"{stack['base']}{PREFIX}/v1/{'chat/' if 'messages' in body else ''}"
                          "completions", timeout=120,
                          headers={"Authorization": f"Bearer {stack['keys'][tenant]}"},
                          json={"model": MODEL, "max_tokens": 2, **body})

    def settled(total: int) -> dict[str, int]:
        """The counts once a router's view holds ``total`` requests (the two routers poll on
        their own; a view that lags is waited out, never compared)."""
        return wait_until(lambda: (x := replicas()) and sum(x.values()) == total and x, 30)

    counts: list[dict[str, int]] = []
    request_ids: list[str] = []

    def send(tenant: str, **body: object) -> str:
        """Send one request as ``tenant``; the id of the replica that took it (its request id
        is appended to ``request_ids``)."""
        before = counts[-1]
        r = post(tenant, **body)
        assert r.status_code == 200, r.text
        request_ids.append(r.headers["x-request-id"].split(",")[0])
        after = settled(sum(before.values()) + 1)
        counts.append(after)
        (served,) = [rid for rid, n in after.items() if n > before.get(rid, 0)]
        return served

    def flood(tenant: str, n: int, **body: object) -> dict[str, int]:
        """``n`` requests of ``tenant`` at once; the requests each replica took."""
        before = counts[-1]
        with ThreadPoolExecutor(n) as pool:
            statuses = list(pool.map(lambda _: post(tenant, **body).status_code, range(n)))
        assert statuses == [200] * n
        after = settled(sum(before.values()) + n)
        counts.append(after)
        return {rid: after[rid] - before.get(rid, 0) for rid in after}

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
    def agreed() -> dict[str, int] | None:
        # Reads (each from either router) that agree over several feed polls: no request is
        # in flight, and both routers' views are current. (Reads within one poll period agreed
        # on a view both routers had not refreshed yet.)
        # A router that has served nothing yet has no view ({}): it has nothing old either.
        start, views = time.monotonic(), [replicas()]
        while time.monotonic() - start < 6 * FEED_POLL_S:
            views.append(replicas())
        views = [v for v in views if v]
        return views[0] if len(views) > 3 and all(v == views[0] for v in views) else None

    counts.append(wait_until(agreed, 30))
    yield {"send": send, "flood": flood, "replicas": replicas, "request_ids": request_ids,
           "usage_dir": stack["usage_dir"]}
    serve.delete(APP)


def _predicted(tenant: str, replica_ids: list[str], **prompt: object) -> str:
    request = GenerationRequest("r", SamplingOptions(), cache_salt=Tenant(tenant).cache_salt,
                                **prompt)  # type: ignore[arg-type]
    key = KEYER.key(request)
    assert key is not None
    return rendezvous_order(key, replica_ids)[0]


def _prefix_hit_rate(affinity, request_ids: list[str]) -> float:
    """Cached prompt tokens over prompt tokens of ``request_ids``, as vLLM reported them for
    each request (the usage records' ``cached_tokens``: what its prefix-cache hit counter
    counts)."""
    from serve_app.governance.usage import read_records, usage_files

    def records() -> list[dict] | None:
        found = {r["request_id"]: r for r in read_records(usage_files([affinity["usage_dir"]]))
                 if r["request_id"] in request_ids}
        return list(found.values()) if len(found) == len(request_ids) else None

    recs = wait_until(records, 10)
    return sum(r["cached_tokens"] for r in recs) / sum(r["prompt_tokens"] for r in recs)


def test_a_tenants_shared_prefix_stays_on_one_replica(affinity):
    """Six requests that share a 900-token prefix land on its replica; after the first (the
    warm-up), vLLM found >= 0.9 of their prompt tokens in its prefix cache."""
    ids = sorted(affinity["replicas"]())
    prompt = (_system_prompt(1) * 3)[:900]  # a character per token (the tiny model)
    first = len(affinity["request_ids"])
    served = {affinity["send"]("team-a", prompt=f"{prompt} Question {i}: why?")
              for i in range(PER_TENANT)}
    assert served == {_predicted("team-a", ids, prompt=prompt)}
    after_warm_up = affinity["request_ids"][first + 1:]
    hit_rate = _prefix_hit_rate(affinity, after_warm_up)
    print(f"\nprefix-cache hit rate after the warm-up: {hit_rate:.3f} ({len(after_warm_up)} "
          "requests)")
    assert hit_rate >= 0.9, hit_rate
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


def test_a_tenant_that_floods_its_replica_spills_to_the_other(affinity):
    """Bounded load: once the key's replica holds more than the margin above the other, the
    rest go to the other replica, and the other never takes more than the margin beyond the
    key's replica."""
    ids = sorted(affinity["replicas"]())
    prompt = _system_prompt(50)
    home = _predicted("team-c", ids, prompt=prompt)
    taken = affinity["flood"]("team-c", 12, prompt=prompt, max_tokens=96, ignore_eos=True)
    other = next(rid for rid in ids if rid != home)
    assert taken[other] >= 1, taken
    # Within the margin: the other replica takes a request only while the key's holds more
    # than the margin above it, but requests that end on the key's replica during the flood
    # free places there, so the split can come out even or tip by up to the margin (6/6 seen
    # twice, 5/7 once, in full suite runs).
    assert taken[home] >= taken[other] - MARGIN, taken
