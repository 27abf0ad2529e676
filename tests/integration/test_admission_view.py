"""Admission follows the replicas that answer: a replica whose load answer does not come (its
process stopped for 3 s, as a replica whose event loop is stuck) drops out of the router's view
within one poll bound, the router keeps admitting to the other, and the replica comes back into
the view when it answers again. The real router, Serve and HAProxy; two replicas of the scripted
engine behind them."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from .conftest import wait_until

pytestmark = pytest.mark.integration

APP = "slowview"
PREFIX = "/slowview"
MODEL = "scripted-two"
BATCH = 4


@pytest.fixture(scope="module")
def two_replicas(stack):
    from ray import serve

    from serve_app.app import build_app, llm_server_name
    from serve_app.config import AutoscalingSettings, ModelSettings
    from serve_app.engine.scripted import SCRIPTED_ENGINE_CLASS

    model = ModelSettings(name=MODEL, path=str(stack["path"]), device="cpu", max_model_len=2048,
                          autoscaling=AutoscalingSettings(min_replicas=2, max_replicas=2),
                          engine_kwargs={"max_num_seqs": BATCH, "scripted_step_s": 0.02})
    cfg = stack["config"]
    serve.run(build_app(cfg.model_copy(update={"models": [model]}), SCRIPTED_ENGINE_CLASS),
              name=APP, route_prefix=PREFIX, blocking=False)
    router = serve.get_deployment_handle("Router", app_name=APP)

    def state() -> dict:
        return router.admission_state.remote().result(timeout_s=30)[MODEL]

    def send(max_tokens: int = 5) -> int:
        return httpx.post(f"{stack['base']}{PREFIX}/v1/completions", headers=stack["headers"],
                          timeout=120, json={"model": MODEL, "prompt": "hi",
                                             "max_tokens": max_tokens}).status_code

    wait_until(lambda: _ok(send), 120, 0.2)
    yield {"state": state, "send": send,
           "replica_class": f"ServeReplica:{APP}:{llm_server_name(MODEL)}"}
    serve.delete(APP)


def _ok(send) -> bool:
    try:
        return send() == 200
    except httpx.HTTPError:
        return False


def test_a_replica_that_stops_answering_drops_out_of_the_view_and_the_other_keeps_serving(
        two_replicas):
    from ray.util.state import list_actors

    s = two_replicas
    wait_until(lambda: s["state"]()["replicas"] == 2, 60, 0.2)
    actors = list_actors(filters=[("class_name", "=", s["replica_class"]),
                                  ("state", "=", "ALIVE")])
    assert len(actors) == 2
    stopped = actors[0]["pid"]
    os.kill(stopped, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        # Keep the router's feed polling (it polls fast while requests are out).
        with ThreadPoolExecutor(4) as pool:
            pending = [pool.submit(s["send"], 200) for _ in range(4)]
            view = wait_until(lambda: (x := s["state"]())["replicas"] == 1 and x, 10, 0.05)
            dropped_after = time.monotonic() - t0
            # The live replica's capacity is admitted: more than the cold-start probe.
            assert view["capacity"] > 1, view
            os.kill(stopped, signal.SIGCONT)
            stopped = 0
            statuses = [p.result(timeout=120) for p in pending]
    finally:
        if stopped:
            os.kill(stopped, signal.SIGCONT)
    assert statuses == [200] * 4
    wait_until(lambda: s["state"]()["replicas"] == 2, 30, 0.1)  # back in the view
    print(f"\nthe stopped replica left the router's view {dropped_after:.2f} s after SIGSTOP")
    # One poll bound (2 s) plus a poll interval, and the state call itself.
    assert dropped_after <= 4.0
