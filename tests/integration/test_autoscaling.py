"""Queue-depth autoscaling on the real stack: a second app whose model may run 0..2 replicas.

One cold start from zero, a flood that scales it out to two replicas and back, and the idle
model going back to zero; every stream ends with a finish reason and [DONE]. The times measured
here (backlog -> decision -> second replica serving) are printed for bench/RESULTS.md.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from .conftest import REPO, wait_until

pytestmark = pytest.mark.integration

APP = "autoscale"
PREFIX = "/autoscale"
MODEL = "tiny-scaled"
BATCH = 4  # max_num_seqs of the scaled model = its per-replica target


@pytest.fixture(scope="module")
def scaled(stack):
    """The autoscaled app beside the shared stack (same Ray, same HAProxy ingress)."""
    from ray import serve

    from serve_app.app import build_app, llm_server_name
    from serve_app.config import load_config

    base_cfg = load_config(REPO / "deployments" / "local-cpu.yaml")
    model = base_cfg.models[0].model_copy(update={
        "name": MODEL,
        "engine_kwargs": {**base_cfg.models[0].engine_kwargs, "max_num_seqs": BATCH},
        "autoscaling": base_cfg.models[0].autoscaling.model_copy(update={
            "min_replicas": 0, "max_replicas": 2, "target_per_replica": BATCH,
            "metrics_interval_s": 0.5, "look_back_period_s": 2.0, "upscale_delay_s": 1.0,
            "downscale_delay_s": 5.0, "idle_timeout_s": 8.0}),
    })
    router = base_cfg.router.model_copy(update={"admission": base_cfg.router.admission
                                                .model_copy(update={"poll_interval_s": 0.05})})
    cfg = base_cfg.model_copy(update={"models": [model], "router": router})
    serve.run(build_app(cfg), name=APP, route_prefix=PREFIX, blocking=False)
    name = llm_server_name(MODEL)

    def replicas() -> dict[str, int]:
        app = serve.status().applications.get(APP)
        if app is None or name not in app.deployments:
            return {}
        return {str(k.value if hasattr(k, "value") else k): v
                for k, v in app.deployments[name].replica_states.items()}

    wait_until(lambda: httpx.get(f"{stack['base']}{PREFIX}/health", timeout=5)
               .status_code == 200, 120, 0.5)
    yield {"base": stack["base"] + PREFIX, "replicas": replicas}
    serve.delete(APP)


async def _stream(client: httpx.AsyncClient, base: str, max_tokens: int) -> dict:
    """One streamed completion: status, time to first token, finish reason, [DONE] seen."""
    t0 = time.monotonic()
    out = {"status": None, "ttft": None, "finish": None, "done": False}
    async with client.stream("POST", f"{base}/v1/completions", json={
            "model": MODEL, "prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}) as r:
        out["status"] = r.status_code
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                out["done"] = True
            elif line.startswith("data: "):
                choice = json.loads(line[6:])["choices"]
                if out["ttft"] is None:
                    out["ttft"] = time.monotonic() - t0
                if choice and choice[0].get("finish_reason"):
                    out["finish"] = choice[0]["finish_reason"]
    return out


def _watch(replicas, until: threading.Event, log: list) -> None:
    """Record (time, replica states) whenever they change."""
    last = None
    while not until.is_set():
        now = replicas()
        if now != last:
            log.append((time.monotonic(), now))
            last = now
        time.sleep(0.1)


def _running(states: dict[str, int]) -> int:
    return states.get("RUNNING", 0)


def test_listing_models_leaves_a_model_at_zero_regression(scaled):
    """GET /v1/models asked every model's engine for its card: at zero replicas the call
    queued in Serve's handle, Serve counted it as demand, and a client listing models kept the
    model warm. The card comes from the config (and the last answer of a live engine). Asking
    /ready does not wake it either, and a model allowed to sit at zero is ready there (its
    requests wake it)."""
    assert _running(scaled["replicas"]()) == 0
    stop, log = threading.Event(), []
    watcher = threading.Thread(target=_watch, args=(scaled["replicas"], stop, log))
    watcher.start()
    try:
        deadline = time.monotonic() + 12  # past upscale_delay_s and the look-back period
        while time.monotonic() < deadline:
            r = httpx.get(f"{scaled['base']}/v1/models", timeout=10)
            assert r.status_code == 200, r.text
            cards = r.json()["data"]
            assert [c["id"] for c in cards] == [MODEL] and "max_model_len" in cards[0], cards
            r = httpx.get(f"{scaled['base']}/ready", timeout=10)
            assert (r.status_code, r.json()) == (
                200, {"status": "ready", "models": 1, "models_loading": 0}), r.text
            time.sleep(0.5)
    finally:
        stop.set()
        watcher.join()
    assert log and all(sum(states.values()) == 0 for _, states in log), log


def test_cold_model_serves_five_requests_from_zero(scaled):
    assert _running(scaled["replicas"]()) == 0
    stop, log = threading.Event(), []
    watcher = threading.Thread(target=_watch, args=(scaled["replicas"], stop, log))
    watcher.start()
    t0 = time.monotonic()

    async def main() -> list[dict]:
        async with httpx.AsyncClient(timeout=600) as client:
            return await asyncio.gather(*[_stream(client, scaled["base"], 16) for _ in range(5)])

    try:
        results = asyncio.run(main())
    finally:
        stop.set()
        watcher.join()
    assert [r["status"] for r in results] == [200] * 5, results
    assert all(r["done"] and r["finish"] == "length" for r in results), results
    cold_start = next(t for t, s in log if _running(s) >= 1) - t0
    worst = max(r["ttft"] for r in results)
    print(f"\ncold start: first replica running after {cold_start:.1f} s; "
          f"first tokens after {min(r['ttft'] for r in results):.1f}-{worst:.1f} s")
    assert worst <= cold_start + 3.0


@pytest.mark.long  # two minutes of flood, scale-out and scale-in: `make test-long`
def test_flood_scales_out_to_two_replicas_and_back_without_cutting_streams(scaled, stack):
    from ray import serve

    router = serve.get_deployment_handle("Router", app_name=APP)
    stop, log, capacity = threading.Event(), [], []
    watcher = threading.Thread(target=_watch, args=(scaled["replicas"], stop, log))
    watcher.start()
    if not _running(scaled["replicas"]()):
        # At zero (`make test-long` runs this test without the cold-start tests before it):
        # one request wakes the model, and the flood starts from one serving replica.
        async def wake() -> dict:
            async with httpx.AsyncClient(timeout=600) as client:
                return await _stream(client, scaled["base"], 1)

        assert asyncio.run(wake())["status"] == 200
    wait_until(lambda: _running(scaled["replicas"]()) == 1, 60)
    t0 = time.monotonic()

    async def main() -> list[dict]:
        """Keep 2 x the per-replica target streaming until the router sees two replicas."""
        results: list[dict] = []
        async with httpx.AsyncClient(timeout=900) as client:
            async def worker() -> None:
                while not seen_two.is_set() and time.monotonic() - t0 < 400:
                    results.append(await _stream(client, scaled["base"], 64))

            async def probe() -> None:
                while not seen_two.is_set():
                    state = (await router.admission_state.remote())[MODEL]
                    capacity.append((time.monotonic() - t0, state["replicas"],
                                     state["capacity"], state["queued"]))
                    if state["replicas"] == 2 and state["queued"] == 0:
                        seen_two.set()
                    await asyncio.sleep(0.25)
                    if time.monotonic() - t0 > 400:
                        return

            await asyncio.gather(probe(), *[worker() for _ in range(2 * BATCH + 2)])
        return results

    seen_two = threading.Event()
    try:
        results = asyncio.run(main())
        flood_end = time.monotonic()
        # After the flood: back to one replica (one step down; zero comes after the idle time).
        wait_until(lambda: any(_running(s) == 1 and t > flood_end for t, s in log), 90, 0.2)
    finally:
        stop.set()
        watcher.join()
    failed = [r for r in results if r["status"] != 200 or not r["done"] or r["finish"] != "length"]
    assert results and not failed, failed
    decided = next(t for t, s in log if sum(s.values()) >= 2) - t0
    serving = next(t for t, s in log if _running(s) >= 2) - t0
    cap_one = max(c for _, n, c, _ in capacity if n == 1)
    cap_two = max(c for _, n, c, _ in capacity if n == 2)
    down = next(t for t, s in log if t > flood_end and _running(s) == 1) - flood_end
    print(f"\nflood of {len(results)} streams: second replica decided {decided:.1f} s and serving {serving:.1f} s "
          f"after the backlog began; router capacity {cap_one} -> {cap_two}; back to one "
          f"replica {down:.1f} s after the flood ended")
    assert decided <= 5.0, f"scale-up decided {decided:.1f} s after the backlog began"
    # With one replica the router held a backlog; once the second served, its capacity took
    # the whole load and the queue emptied.
    assert any(q > 0 for _, n, _, q in capacity if n == 1), capacity
    assert seen_two.is_set(), capacity


@pytest.mark.long  # 18 s; the make-test tier keeps the model at zero before its first request
def test_idle_model_returns_to_zero(scaled):
    t0 = time.monotonic()
    wait_until(lambda: sum(scaled["replicas"]().values()) == 0, 120, 0.5)
    print(f"\nidle model at zero replicas {time.monotonic() - t0:.1f} s later")


@pytest.mark.long  # 32 s: the make-test tier keeps the first burst from zero (above)
def test_a_model_back_at_zero_serves_a_second_burst_regression_stale_view(scaled):
    """After the model went back to zero, a second burst from zero: the router's view of the
    model is empty (not the last replicas it saw, whose capacity let a burst skip the fair
    queue into Serve's handle queue), one request wakes the autoscaler, and every request of
    the burst is served whole."""
    wait_until(lambda: sum(scaled["replicas"]().values()) == 0, 120, 0.5)

    async def main() -> list[dict]:
        async with httpx.AsyncClient(timeout=600) as client:
            return await asyncio.gather(*[_stream(client, scaled["base"], 8) for _ in range(6)])

    results = asyncio.run(main())
    assert [r["status"] for r in results] == [200] * 6, results
    assert all(r["done"] and r["finish"] == "length" for r in results), results
