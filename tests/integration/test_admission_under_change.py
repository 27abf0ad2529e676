"""Admission while the router and engine replica sets change (issue 27), through the real
router, Serve and HAProxy, with the scripted engine (its steps are timed, so what the
engines run is deterministic enough to measure on a loaded 2-core machine).

* Two routers, nearly all the load on one (clients pinned to one router replica's port, one
  request at a time on the other's): the engines run what one router alone would run. The
  fixed split by the router count held it to half (capacity / 2 per router) while the other
  router idled, and so would an even split over the routers that report a demand.
* A scale-down and then a rolling update under a backlog: admission follows the new view at
  once (within a second), the queue never waits more than 2 s while the engines have room,
  and no request fails or is cut.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from .conftest import wait_until
from .load import finish, start, streams

pytestmark = pytest.mark.integration

STEP_S = 0.02


def _deploy(stack, app: str, prefix: str, model_name: str, batch: int, replicas: int,
            routers: int = 1, step_s: float = STEP_S) -> None:
    from ray import serve

    from serve_app.app import build_app
    from serve_app.config import AutoscalingSettings, ModelSettings
    from serve_app.engine.scripted import SCRIPTED_ENGINE_CLASS

    model = ModelSettings(name=model_name, path=str(stack["path"]), device="cpu",
                          max_model_len=2048,
                          autoscaling=AutoscalingSettings(min_replicas=replicas,
                                                          max_replicas=replicas),
                          engine_kwargs={"max_num_seqs": batch, "scripted_step_s": step_s})
    cfg = stack["config"]
    router = cfg.router.model_copy(update={"num_replicas": routers})
    serve.run(build_app(cfg.model_copy(update={"models": [model], "router": router}),
                      SCRIPTED_ENGINE_CLASS), name=app, route_prefix=prefix, blocking=False)


def _state(app: str, model: str) -> dict[str, Any]:
    from ray import serve

    router = serve.get_deployment_handle("Router", app_name=app)
    return router.admission_state.remote().result(timeout_s=30)[model]


def _serves(base: str, model: str, headers: dict) -> bool:
    try:
        return httpx.post(f"{base}/v1/completions", headers=headers, timeout=60,
                          json={"model": model, "prompt": "hi", "max_tokens": 2}
                          ).status_code == 200
    except httpx.HTTPError:
        return False


class _Sampler:
    """Samples the router's admission state every ``interval_s`` in a thread."""

    def __init__(self, app: str, model: str, interval_s: float = 0.05) -> None:
        self.app, self.model, self.interval_s = app, model, interval_s
        self.samples: list[tuple[float, dict[str, Any]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append((time.monotonic(), _state(self.app, self.model)))
            except Exception:  # a state call during a redeploy: skip the sample
                pass
            self._stop.wait(self.interval_s)


# -- two routers, the load on one ----------------------------------------------------------
TWO_APP, TWO_PREFIX, TWO_MODEL, TWO_BATCH = "tworouters", "/tworouters", "scripted-two-routers", 16


def test_two_routers_with_the_load_on_one_run_the_whole_engine_regression_split_by_count(stack):
    """Two router replicas, each reached on its own port: 48 clients on one, a trickle of one
    request at a time on the other. The engine runs >= 90% of its batch, what demand sharing
    gives (about 15 + 1 of 16). A split by the router count, or an even split over the routers
    that report a demand (the trickle makes the second one report), gives 8 + 1."""
    from ray import serve

    from serve_app.app import llm_server_name
    from serve_app.launch import router_replica_ports

    _deploy(stack, TWO_APP, TWO_PREFIX, TWO_MODEL, TWO_BATCH, replicas=1, routers=2)
    try:
        wait_until(lambda: _serves(f"{stack['base']}{TWO_PREFIX}", TWO_MODEL, stack["headers"]),
                   120, 0.2)
        wait_until(lambda: _running_routers(TWO_APP) == 2, 120, 0.2)

        def both_ports() -> list[int] | None:
            found = router_replica_ports(TWO_APP, TWO_PREFIX) or router_replica_ports(TWO_APP)
            return found if len(found) == 2 else None

        ports = wait_until(both_ports, 60, 0.2)
        busy, quiet = (_replica_base(port, TWO_MODEL, stack["headers"]) for port in ports)
        results: list = []
        trickle: list = []
        stop, threads = start(*[(_long_streams, busy, TWO_MODEL, stack["headers"], results)
                                for _ in range(3 * TWO_BATCH)],
                              (_long_streams, quiet, TWO_MODEL, stack["headers"], trickle))
        # The engine's own count (a call to the replica, not through either router).
        server = serve.get_deployment_handle(llm_server_name(TWO_MODEL), app_name=TWO_APP)

        def engine_running() -> int:
            return server.engine_load.remote().result(timeout_s=30).running

        try:
            # Both routers poll and report their demands once the trickle's first stream ended.
            wait_until(lambda: trickle and engine_running() > 0, 60, 0.05)
            running: list[int] = []
            deadline = time.monotonic() + 4.0
            while time.monotonic() < deadline:
                running.append(engine_running())
                time.sleep(0.05)
        finally:
            finish(stop, threads)
        running.sort()
        median = running[len(running) // 2]
        print(f"\nengine running with the load on one of two routers: median {median} of "
              f"{TWO_BATCH} (samples {len(running)}, min {running[0]}, max {running[-1]})")
        assert results and all(r == (200, True) for r in results), \
            [r for r in results if r != (200, True)][:5]
        assert trickle and all(r == (200, True) for r in trickle), trickle[:5]
        assert median >= 0.9 * TWO_BATCH, running
    finally:
        serve.delete(TWO_APP)


def _long_streams(base: str, model: str, headers: dict, results: list,
                  stop: threading.Event) -> None:
    """One stream of 60 tokens (~1.2 s of engine steps) after another, until stopped."""
    with httpx.Client(base_url=base, timeout=120, headers=headers) as c:
        while not stop.is_set():
            try:
                with c.stream("POST", "/v1/completions", json={
                        "model": model, "prompt": "one router", "max_tokens": 60,
                        "ignore_eos": True, "stream": True}) as r:
                    lines = list(r.iter_lines())
                results.append((r.status_code, "data: [DONE]" in lines))
            except httpx.HTTPError as err:
                results.append((type(err).__name__, False))


def _running_routers(app: str) -> int:
    from ray import serve

    status = serve.status().applications[app].deployments["Router"]
    return int(status.replica_states.get("RUNNING", 0))


def _replica_base(port: int, model: str, headers: dict) -> str:
    """The base URL of a router replica's own port (the replica serves the app's routes)."""
    for base in (f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}{TWO_PREFIX}"):
        if _serves(base, model, headers):
            return base
    raise AssertionError(f"the router replica on port {port} does not serve completions")


# -- scale-down and rolling update under a backlog ----------------------------------------
ROLL_APP, ROLL_PREFIX, ROLL_MODEL, ROLL_BATCH = "rollout", "/rollout", "scripted-rollout", 4


# 34 s of make test; make test keeps replicas coming and going in the two routers' test above
# and the router rolls of test_live_config.py.
@pytest.mark.long
def test_scale_down_and_rolling_update_under_a_backlog_keep_admitting(stack):
    """A backlog of streams (24 clients on 2 replicas of 4 places); the model is scaled down
    to one replica, then rolled to a new version. After each change of the live set admission
    resumes within a second; the queue never waits over 2 s while the engines have room; every
    stream ends whole."""
    from ray import serve

    _deploy(stack, ROLL_APP, ROLL_PREFIX, ROLL_MODEL, ROLL_BATCH, replicas=2)
    base = f"{stack['base']}{ROLL_PREFIX}"
    try:
        wait_until(lambda: _serves(base, ROLL_MODEL, stack["headers"]), 120, 0.2)
        wait_until(lambda: _state(ROLL_APP, ROLL_MODEL)["replicas"] == 2, 60, 0.1)
        results: list = []
        stop, threads = start(*[(streams, base, ROLL_MODEL, stack["headers"], results)
                                for _ in range(24)])
        with _Sampler(ROLL_APP, ROLL_MODEL) as sampler:
            try:
                wait_until(lambda: _state(ROLL_APP, ROLL_MODEL)["queued"] > 0, 60, 0.05)
                before = {r["replica"] for r in _state(ROLL_APP, ROLL_MODEL)["per_replica"]}
                _deploy(stack, ROLL_APP, ROLL_PREFIX, ROLL_MODEL, ROLL_BATCH, replicas=1)
                wait_until(lambda: _state(ROLL_APP, ROLL_MODEL)["replicas"] == 1, 120, 0.05)
                _wait_for_requests(12)  # the backlog runs on the one replica a while
                # A new version (another step time): Serve replaces the replica.
                _deploy(stack, ROLL_APP, ROLL_PREFIX, ROLL_MODEL, ROLL_BATCH, replicas=1,
                        step_s=STEP_S * 1.05)
                wait_until(lambda: (s := _state(ROLL_APP, ROLL_MODEL))["replicas"] == 1 and not (
                    {r["replica"] for r in s["per_replica"]} & before), 180, 0.05)
                _wait_for_requests(12)
            finally:
                finish(stop, threads)
        failed = [r for r in results if r != (200, True)]
        assert results and not failed, failed[:5]
        _check_admission_followed_the_views(sampler.samples)
    finally:
        serve.delete(ROLL_APP)


def _wait_for_requests(n: int) -> None:
    """Until the live replicas took ``n`` more requests."""
    def taken() -> int:
        return sum(r["requests_total"] for r in _state(ROLL_APP, ROLL_MODEL)["per_replica"])

    first = taken()
    wait_until(lambda: taken() >= first + n, 120, 0.05)


def _check_admission_followed_the_views(samples: list[tuple[float, dict[str, Any]]]) -> None:
    """After each change of the live replica set, a request is admitted to it within a second
    (its replicas' requests_total grows) while the queue has work; and no stretch over 2 s
    has work queued while the engines (by the view) have free places."""
    changes = 0
    for i in range(1, len(samples)):
        t, s = samples[i]
        live = {r["replica"] for r in s["per_replica"]}
        prev = {r["replica"] for r in samples[i - 1][1]["per_replica"]}
        if live == prev or not live or not s["queued"]:
            continue
        changes += 1
        taken = sum(r["requests_total"] for r in s["per_replica"])
        resumed = next((u for u, x in samples[i + 1:] if {
            r["replica"] for r in x["per_replica"]} == live and sum(
                r["requests_total"] for r in x["per_replica"]) > taken), None)
        assert resumed is not None and resumed - t <= 1.0, (
            f"admission did not resume within 1 s of the view {sorted(live)} "
            f"(resumed after {None if resumed is None else round(resumed - t, 2)} s)")
    assert changes >= 2, "the test saw no scale-down and no rollout in the view"
    gap_from = None
    worst = 0.0
    for t, s in samples:
        room = s["replicas"] * ROLL_BATCH - s["engine_running"] - s["engine_waiting"]
        if s["queued"] > 0 and room > 0 and s["replicas"] > 0:
            gap_from = t if gap_from is None else gap_from
            worst = max(worst, t - gap_from)
        else:
            gap_from = None
    print(f"\nview changes {changes}; longest stretch with work queued and room in the engines "
          f"{worst:.2f} s over {len(samples)} samples")
    assert worst <= 2.0
