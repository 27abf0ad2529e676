"""One quota state per cluster (issue 29), on a real app with two router replicas (the scripted
engine behind them: the quota is the router's business, so no model is needed).

A tenant with requests_per_minute: 6 gets 6 requests in a minute (±1), whether it sends them to
one router replica's own port or spreads them over both, and a router replica killed and
replaced in the middle refills nothing. (With each replica holding half of the limit, the first
case got 3 and a restart refilled its half.) The bucket refills one request every 10 s, so each
check allows what refilled during the test."""

from __future__ import annotations

import time

import httpx
import pytest

from .conftest import wait_until

pytestmark = pytest.mark.integration

APP = "quota2"
PREFIX = "/quota2"
MODEL = "scripted-quota"
RPM = 6
TENANTS = ("one-router", "both-routers", "router-restart")


@pytest.fixture(scope="module")
def two_routers(stack):
    """An app of two router replicas in front of one scripted engine, with tenants of its own
    (RPM 6 each); yields their keys and a function listing the router replicas' own ports."""
    from ray import serve

    from serve_app.app import build_app
    from serve_app.config import ModelSettings, TenantSettings
    from serve_app.engine.scripted import SCRIPTED_ENGINE_CLASS
    from serve_app.tenancy.keys import key_digest, new_key

    cfg = stack["config"]
    keys = {name: new_key() for name in TENANTS}
    tenants = [TenantSettings(name=n, api_key_sha256=[key_digest(k)], requests_per_minute=RPM)
               for n, k in keys.items()]
    model = ModelSettings(name=MODEL, path=str(stack["path"]), device="cpu", max_model_len=2048,
                          engine_kwargs={"max_num_seqs": 8, "scripted_step_s": 0.005})
    router = cfg.router.model_copy(update={"num_replicas": 2})
    serve.run(build_app(cfg.model_copy(update={"models": [model], "router": router,
                                               "tenants": tenants}), SCRIPTED_ENGINE_CLASS),
              name=APP, route_prefix=PREFIX, blocking=False)
    wait_until(lambda: len(_router_ports()) == 2, 180, 0.5)
    yield keys
    serve.delete(APP)


def _router_ports() -> list[int]:
    """The HTTP ports this app's router replicas listen on themselves (that answer)."""
    import psutil

    ports = []
    for proc in psutil.process_iter(["cmdline"]):
        if not any(f"ServeReplica:{APP}:Router" in a for a in proc.info["cmdline"] or []):
            continue
        for conn in proc.net_connections(kind="tcp"):
            if conn.status != psutil.CONN_LISTEN:
                continue
            try:
                if httpx.get(f"http://127.0.0.1:{conn.laddr.port}{PREFIX}/health",
                             timeout=2).status_code == 200:
                    ports.append(int(conn.laddr.port))
                    break
            except httpx.HTTPError:
                continue
    return sorted(ports)


def _send(port: int, key: str) -> int:
    r = httpx.post(f"http://127.0.0.1:{port}{PREFIX}/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": "hello", "max_tokens": 2},
                   headers={"Authorization": f"Bearer {key}"})
    if r.status_code == 429:
        assert r.json()["error"]["code"] == "rate_limit_exceeded" and "retry-after" in r.headers
    return r.status_code


def _allowed(started: float) -> int:
    """Requests a full bucket of RPM admits since ``started``: RPM, plus its refill, plus 1."""
    return RPM + int((time.monotonic() - started) * RPM / 60) + 1


def test_the_whole_limit_through_one_router_replica(two_routers):
    port = _router_ports()[0]
    started = time.monotonic()
    codes = [_send(port, two_routers["one-router"]) for _ in range(12)]
    ok = codes.count(200)
    assert RPM - 1 <= ok <= _allowed(started), codes
    assert set(codes) == {200, 429}


def test_the_same_limit_spread_over_both_router_replicas(two_routers):
    ports = _router_ports()
    started = time.monotonic()
    codes = [_send(ports[i % 2], two_routers["both-routers"]) for i in range(12)]
    assert RPM - 1 <= codes.count(200) <= _allowed(started), codes


def test_a_router_replica_replaced_in_the_middle_refills_nothing(two_routers):
    import ray
    from ray.util.state import list_actors

    key = two_routers["router-restart"]
    ports = _router_ports()
    started = time.monotonic()
    first = [_send(ports[i % 2], key) for i in range(RPM)]
    assert first.count(200) >= RPM - 1, first
    routers = [a for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
               if a.class_name.startswith(f"ServeReplica:{APP}:Router")]
    ray.kill(ray.get_actor(routers[0].name, namespace="serve"), no_restart=True)

    def replaced() -> bool:
        alive = {a.actor_id for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
                 if a.class_name.startswith(f"ServeReplica:{APP}:Router")}
        return len(alive) == 2 and routers[0].actor_id not in alive \
            and len(_router_ports()) == 2
    wait_until(replaced, 120, 0.5)
    after = [_send(p, key) for p in _router_ports() for _ in range(3)]
    total = first.count(200) + after.count(200)
    assert total <= _allowed(started), (first, after, time.monotonic() - started)
