"""Changes to the running stack through `serve-app deploy`.

Tenants change live: with a tenant removed its key answers 401 within 10 s while other tenants'
streams run on, and nothing restarts (the same router and engine replicas serve before and
after); restoring the tenant brings its key back. An engine argument rolls the engine replicas
behind the same router replicas: new ones start, the old ones finish their requests, and a
steady load of streamed and whole requests sees no failure and no cut stream (when the router
rolled too, HAProxy's reload dropped 2 of ~20 streams' keep-alive connections)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from .conftest import wait_until
from .load import streams, whole_requests

pytestmark = pytest.mark.integration

# The engine roll's limit (the old replica drains, the new one starts: about 50 s here).
ROLL_S = 300.0


def _replica_actors(deployment: str = "") -> set[str]:
    """Live replica actors of the app (of one deployment when named: a prefix of its name)."""
    from ray.util.state import list_actors

    return {a.actor_id for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
            if a.class_name.startswith(f"ServeReplica:llm:{deployment}")}


def test_removed_tenant_is_refused_within_seconds_without_restarts(stack):
    from serve_app.launch import deploy, status

    cfg = stack["config"]
    key_c = {"Authorization": f"Bearer {stack['keys']['team-c']}"}
    models = f"{stack['base']}/v1/models"
    assert httpx.get(models, headers=key_c, timeout=10).status_code == 200
    before = _replica_actors()
    results: list = []
    stop = threading.Event()
    streamer = threading.Thread(target=streams, args=(stack["base"], stack["model"],
                                                       stack["headers"], results, stop),
                                daemon=True)
    streamer.start()
    try:
        without_c = cfg.model_copy(update={"tenants": [t for t in cfg.tenants
                                                       if t.name != "team-c"]})
        t0 = time.monotonic()
        assert deploy(without_c, address=None).mode == "live"
        wait_until(lambda: httpx.get(models, headers=key_c, timeout=10).status_code == 401,
                   10, 0.1)
        revoked_after = time.monotonic() - t0
        assert "team-c" not in status(address=None)["tenants"]
        wait_until(lambda: len(results) >= 3, 60, 0.2)  # streams went on meanwhile
    finally:
        stop.set()
        streamer.join(timeout=120)
        assert deploy(cfg, address=None).mode == "live"  # put it back, whatever happened
    wait_until(lambda: httpx.get(models, headers=key_c, timeout=10).status_code == 200, 10, 0.1)
    assert results and all(r == (200, True) for r in results), results
    assert _replica_actors() == before  # no router or engine replica was replaced
    print(f"\nkey revoked after {revoked_after:.2f} s; {len(results)} streams ran through it")


@pytest.mark.long  # an engine start (~40 s); make test keeps the scripted engines' roll under
# a backlog (test_admission_under_change.py) and the routers' roll below
def test_engine_argument_change_rolls_replicas_without_a_failed_request_or_cut_stream(stack):
    from ray import serve

    from serve_app.config import APP_NAME
    from serve_app.launch import deploy

    cfg = stack["config"]
    model = cfg.models[0]
    # A new engine seed: a new replica version, and nothing the greedy tests after this see.
    rolled = cfg.model_copy(update={"models": [model.model_copy(update={"engine_kwargs": {
        **model.engine_kwargs, "seed": model.engine_kwargs.get("seed", 0) + 1}})]})
    engines_before, routers_before = _replica_actors("LLMServer"), _replica_actors("Router")
    streamed: list = []
    whole: list = []
    stop = threading.Event()
    team_b = {"Authorization": f"Bearer {stack['keys']['team-b']}"}
    # The model has one replica and the suite's Ray no room for a second engine: Serve stops
    # the old replica and starts the new one together, so for the new engine's start (50 s
    # idle, 61 s beside a CPU hog) the requests wait in the router's queue. They must not fail;
    # the clients wait as long as the roll may take.
    patience = {"patience_s": ROLL_S}
    load = [threading.Thread(target=streams, daemon=True, kwargs=patience,
                             args=(stack["base"], stack["model"], stack["headers"], streamed,
                                   stop))
            for _ in range(2)]
    load.append(threading.Thread(target=whole_requests, daemon=True, kwargs=patience,
                                 args=(stack["base"], stack["model"], team_b, whole, stop)))
    for t in load:
        t.start()
    try:
        wait_until(lambda: len(streamed) >= 2 and whole, 60, 0.2)  # the load is flowing
        t0 = time.monotonic()
        assert deploy(rolled, address=None).mode == "redeployed"
        stack["config"] = rolled  # what runs from now on, for any later deploy

        def rolled_over() -> bool:
            now = _replica_actors("LLMServer")
            app = serve.status().applications[APP_NAME]
            return bool(now) and not (now & engines_before) and app.status == "RUNNING"

        wait_until(rolled_over, ROLL_S, 0.5)
        took = time.monotonic() - t0
        during = len(streamed) + len(whole)
        wait_until(lambda: len(streamed) + len(whole) >= during + 3, 60, 0.2)  # new ones serve
    finally:
        stop.set()
        for t in load:
            t.join(timeout=120)
    # The engines rolled behind the same router replicas (the ingress and HAProxy's backends
    # stay: only the replica set behind the routers' handles changed).
    assert _replica_actors("Router") == routers_before
    assert all(r == (200, True) for r in streamed), [r for r in streamed if r != (200, True)]
    assert all(r == (200, True) for r in whole), [r for r in whole if r != (200, True)]
    print(f"\nrolled the engine replicas in {took:.1f} s; {len(streamed)} streams and "
          f"{len(whole)} whole requests, none failed or cut")


def test_router_setting_change_rolls_the_routers_and_leaves_the_engines(stack):
    """The guard of Serve's private ``options(_internal=True, version=...)``
    (serve_app/serve_private.py): each deployment carries its own version, so a change to a
    router setting alone replaces the router replicas and leaves the engine replicas (minutes
    of GPU start-up each) as they are. Without versions every deploy replaced every replica."""
    from ray import serve

    from serve_app.config import APP_NAME
    from serve_app.launch import deploy

    cfg = stack["config"]
    changed = cfg.model_copy(update={"router": cfg.router.model_copy(
        update={"max_queued_per_band": cfg.router.max_queued_per_band + 1})})
    engines_before, routers_before = _replica_actors("LLMServer"), _replica_actors("Router")
    assert engines_before and routers_before

    def routers_replaced(before: set[str]) -> bool:
        now = _replica_actors("Router")
        app = serve.status().applications[APP_NAME]
        return bool(now) and not (now & before) and app.status == "RUNNING"

    try:
        assert deploy(changed, address=None).mode == "redeployed"
        wait_until(lambda: routers_replaced(routers_before), 180, 0.5)
        assert _replica_actors("LLMServer") == engines_before
    finally:
        rolled = _replica_actors("Router")
        assert deploy(cfg, address=None).mode == "redeployed"  # back to the suite's config
        wait_until(lambda: routers_replaced(rolled), 180, 0.5)
    assert _replica_actors("LLMServer") == engines_before
    reply = httpx.post(f"{stack['base']}/v1/completions", headers=stack["headers"], timeout=60,
                       json={"model": stack["model"], "prompt": "hi", "max_tokens": 2})
    assert reply.status_code == 200, reply.text


def _engine_serve_options(model: str) -> dict:
    """The LLMServer deployment's options as Serve's controller holds them now."""
    from ray.serve.context import _get_global_client

    from serve_app.app import llm_server_name
    from serve_app.config import APP_NAME

    info, _ = _get_global_client().get_deployment_info(llm_server_name(model), APP_NAME)
    return info.deployment_config.model_dump()


def test_router_only_model_fields_leave_the_engines_and_still_reach_serve(stack):
    """A model's max_ongoing_requests and drain_timeout_s are Serve options no engine reads
    (issue 41 item 2): a deploy that changes only them keeps the same engine replicas (in the
    engines' version they replaced every engine), and Serve holds the new values, applied in
    place (max_ongoing_requests through reconfigure() on the running replicas). The routers
    roll: their `fixed` capacity policy reads max_ongoing_requests."""
    from ray import serve

    from serve_app.config import APP_NAME
    from serve_app.launch import deploy

    cfg = stack["config"]
    m = cfg.models[0]
    changed = cfg.model_copy(update={"models": [m.model_copy(update={
        "max_ongoing_requests": m.max_ongoing_requests + 1,
        "drain_timeout_s": m.drain_timeout_s + 1})]})
    engines_before, routers_before = _replica_actors("LLMServer"), _replica_actors("Router")
    assert engines_before and routers_before

    def applied(before: set[str], model) -> bool:
        now = _replica_actors("Router")
        options = _engine_serve_options(model.name)
        app = serve.status().applications[APP_NAME]
        return (bool(now) and not (now & before) and app.status == "RUNNING"
                and options["max_ongoing_requests"] == model.max_ongoing_requests
                and options["graceful_shutdown_timeout_s"] == model.drain_timeout_s)

    try:
        assert deploy(changed, address=None).mode == "redeployed"
        wait_until(lambda: applied(routers_before, changed.models[0]), 180, 0.5)
        assert _replica_actors("LLMServer") == engines_before
    finally:
        rolled = _replica_actors("Router")
        assert deploy(cfg, address=None).mode == "redeployed"  # back to the suite's config
        wait_until(lambda: applied(rolled, m), 180, 0.5)
    assert _replica_actors("LLMServer") == engines_before
    reply = httpx.post(f"{stack['base']}/v1/completions", headers=stack["headers"], timeout=60,
                       json={"model": stack["model"], "prompt": "hi", "max_tokens": 2})
    assert reply.status_code == 200, reply.text
