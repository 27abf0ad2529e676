"""A vLLM engine core that dies under load (OOM killer, driver fault) is a server fault, never a
500 to the client or a hung stream: in-flight streams end with an error event, non-streaming
requests and new requests get an OpenAI-shaped 503, Serve's health check replaces the replica,
and the endpoint serves again without anyone restarting it. One that hangs instead of dying
(a pipeline stage blocked on a lost peer) is found by the stall watch and goes the same way.

The tests kill (or stop) the real engine-core process of the shared stack and wait for the
recovery, so the tests after them run against a fresh replica. A slow step is no hang: a
scripted engine whose step takes 90 s, under the stall watch's production defaults, is left
alone."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import psutil
import pytest
from ray.util.state import list_actors

from serve_app.app import APP_NAME, llm_server_name

from .conftest import ENGINE_STALL_S, engine_load, wait_until

pytestmark = pytest.mark.integration

LONG = {"max_tokens": 1900, "ignore_eos": True}


def _engine_core_processes(model: str) -> list[psutil.Process]:
    """The engine-core processes under this stack's LLMServer replica (not any other vLLM)."""
    actors = list_actors(filters=[("class_name", "=",
                                   f"ServeReplica:{APP_NAME}:{llm_server_name(model)}"),
                                  ("state", "=", "ALIVE")])
    cores = []
    for actor in actors:
        for child in psutil.Process(actor["pid"]).children(recursive=True):
            if "EngineCore" in child.name() or "EngineCore" in " ".join(child.cmdline()):
                cores.append(child)
    return cores


def _stream_until_end(client: httpx.Client, body: dict, first_chunk: threading.Event,
                      out: dict) -> None:
    with client.stream("POST", "/v1/completions", json=body) as r:
        out["status"] = r.status_code
        lines = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                first_chunk.set()
        out["events"] = lines
    first_chunk.set()


@pytest.mark.long  # 30 s, most of it the replica's restart: `make test-long`
def test_engine_death_is_a_503_and_the_replica_recovers(stack):
    model = stack["model"]
    cores = _engine_core_processes(model)
    assert len(cores) == 1, cores

    first_chunk = threading.Event()
    stream_out: dict = {}
    json_out: dict = {}
    with httpx.Client(base_url=stack["base"], timeout=120, headers=stack["headers"]) as client:
        stream = threading.Thread(target=_stream_until_end, args=(
            client, {"model": model, "prompt": "hello", "stream": True, **LONG},
            first_chunk, stream_out))
        blocking = threading.Thread(target=lambda: json_out.update(resp=client.post(
            "/v1/completions", json={"model": model, "prompt": "hello", "n": 4, **LONG})))
        stream.start()
        blocking.start()
        assert first_chunk.wait(60), "the stream never started"
        # The non-streaming request is in the engine too (its n=4 sequences beside the stream).
        wait_until(lambda: engine_load(stack).unfinished >= 2, 60)
        cores[0].send_signal(signal.SIGKILL)
        stream.join(90)
        blocking.join(90)
        assert not stream.is_alive() and not blocking.is_alive(), "a request hung on a dead engine"

        # The stream had started (200), so the fault arrives as an error event, without [DONE].
        assert stream_out["status"] == 200
        events = stream_out["events"]
        assert "[DONE]" not in events, "a cut-off stream must not look complete"
        assert "error" in json.loads(events[-1]), events[-1]

        resp = json_out["resp"]
        assert resp.status_code == 503, (resp.status_code, resp.text)
        assert resp.json()["error"]["type"] == "service_unavailable"

        # Until the replica is replaced, requests get 503 (with Retry-After) or wait; never 500.
        _serves_again(client, model, 240)

    new_cores = _engine_core_processes(model)
    assert len(new_cores) == 1 and new_cores[0].pid != cores[0].pid
    load = stack["server"].engine_load.remote().result(timeout_s=30)
    assert load.unfinished == 0, load


def _gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _serves_again(client: httpx.Client, model: str, within_s: float) -> list:
    """Post until a 200; every answer meanwhile is a 503 with Retry-After (never a 500)."""
    seen = []
    deadline = time.time() + within_s
    while time.time() < deadline:
        r = client.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 4})
        seen.append(r.status_code)
        assert r.status_code in (200, 503), (r.status_code, r.text)
        if r.status_code == 200:
            return seen
        assert "error" in r.json() and r.headers.get("retry-after"), r.text
        time.sleep(1)
    raise AssertionError(f"no recovery in {within_s} s: {seen}")


@pytest.mark.long  # the stall watch's scenarios take a minute each: `make test-long`
def test_a_hung_engine_core_is_killed_by_the_stall_watch_and_the_replica_recovers(stack):
    """SIGSTOP on the engine core under a stream: it neither steps nor dies, as a pipeline
    stage blocked on a peer whose node is gone. Within the model's engine_stall_timeout_s and a
    health-check period the replica kills it: the stream ends with an error event instead of
    hanging, the stopped process is gone (not left holding the engine's memory), and a new
    replica serves."""
    model = stack["model"]
    cores = _engine_core_processes(model)
    assert len(cores) == 1, cores
    first_chunk = threading.Event()
    stream_out: dict = {}
    with httpx.Client(base_url=stack["base"], timeout=300, headers=stack["headers"]) as client:
        stream = threading.Thread(target=_stream_until_end, args=(
            client, {"model": model, "prompt": "hello", "stream": True, **LONG},
            first_chunk, stream_out))
        stream.start()
        assert first_chunk.wait(60), "the stream never started"
        cores[0].send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            stream.join(ENGINE_STALL_S + 120)
            assert not stream.is_alive(), "the stream hung on a stopped engine"
            ended_after = time.monotonic() - stopped_at
            assert stream_out["status"] == 200
            events = stream_out["events"]
            assert "[DONE]" not in events, "a cut-off stream must not look complete"
            assert "error" in json.loads(events[-1]), events[-1]
            wait_until(lambda: _gone(cores[0]), 60, 0.2)
        finally:
            if not _gone(cores[0]):  # the watch failed: leave no stopped process behind
                cores[0].kill()
        seen = _serves_again(client, model, 240)
    new_cores = _engine_core_processes(model)
    assert len(new_cores) == 1 and new_cores[0].pid != cores[0].pid
    print(f"\nstopped engine core: its stream ended {ended_after:.1f} s later "
          f"(engine_stall_timeout_s={ENGINE_STALL_S}); answers until served again: {seen}")


@pytest.mark.long
def test_a_90_s_step_under_the_default_stall_watch_does_not_kill_the_engine(stack):
    """The stall watch's production defaults (the GPU floor, two checks in a row) in front of
    a scripted engine whose first step takes 90 s, longer than the old 60 s timeout: Serve's
    health checks run all through the step (every HEALTH_CHECK_PERIOD_S), the request ends
    with its tokens and the replica is the one it started on. The engine's clock runs 5x
    (scripted_clock_scale), so the 90 s pass in 18 s; the stall watch reads that clock."""
    from ray import serve

    from serve_app.app import HEALTH_CHECK_PERIOD_S, build_app
    from serve_app.config import DEFAULT_STALL_TIMEOUT_S, ModelSettings
    from serve_app.engine.scripted import SCRIPTED_ENGINE_CLASS

    app, model, scale, step_s = "slow-step", "slow-step", 5.0, 90.0
    assert step_s / scale > 3 * HEALTH_CHECK_PERIOD_S  # several checks fall inside the step
    settings = ModelSettings(
        name=model, path=str(stack["path"]), device="cpu", max_model_len=2048,
        engine_stall_timeout_s=DEFAULT_STALL_TIMEOUT_S,  # as on a GPU (off by default on CPU)
        engine_kwargs={"scripted_clock_scale": scale, "scripted_step_s_at": {0: step_s}})
    serve.run(build_app(stack["config"].model_copy(update={"models": [settings]}),
                        SCRIPTED_ENGINE_CLASS), name=app, route_prefix="/" + app, blocking=False)
    try:
        server = serve.get_deployment_handle(llm_server_name(model), app_name=app)
        base = f"{stack['base']}/{app}"
        with httpx.Client(base_url=base, timeout=300, headers=stack["headers"]) as client:
            wait_until(lambda: _models_answer(client), 120, 0.2)
            replica = server.engine_load.remote().result(timeout_s=30).replica
            started = time.monotonic()
            r = client.post("/v1/completions", json={"model": model, "prompt": "hello",
                                                     "max_tokens": 3})
            took = time.monotonic() - started
        assert r.status_code == 200, (r.status_code, r.text)
        assert r.json()["choices"][0]["text"] == " t0 t1 t2"
        assert took >= step_s / scale, took  # the long step really happened
        assert server.engine_load.remote().result(timeout_s=30).replica == replica
    finally:
        serve.delete(app)


def _models_answer(client: httpx.Client) -> bool:
    try:
        return client.get("/v1/models").status_code == 200
    except httpx.HTTPError:
        return False
