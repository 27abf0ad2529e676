"""``GET /ready`` waits for the engines; ``/v1/models`` does not.

Regression (RESULTS 42c): ``/v1/models`` answers from the config as soon as the router is up
(it must never wake a model at zero), and a GPU benchmark that waited on it sent its flood
while the 8B engine was still compiling: the stack arm measured nothing. The engine here is the
scripted one held in its start by a file, as a real replica stays in its constructor while
the model loads; the router, Serve and HAProxy are the real ones.
"""

from __future__ import annotations

import threading

import httpx
import pytest

from serve_app.launch import is_ready, wait_until_serving

from .conftest import scripted_app, wait_until

pytestmark = pytest.mark.integration

APP = "readiness"
PREFIX = "/readiness"
MODEL = "loading-scripted"


def _status(url: str, headers: dict | None = None) -> int:
    try:
        return httpx.get(url, headers=headers, timeout=5).status_code
    except httpx.HTTPError:
        return 0


def test_ready_is_503_while_the_engine_loads_where_models_already_answers(stack, tmp_path):
    from ray import serve

    loaded = tmp_path / "loaded"
    base = stack["base"] + PREFIX
    # serve.run returns only once the replica's constructor has, and that waits for the file.
    deploy = threading.Thread(target=serve.run, daemon=True, args=(
        scripted_app(stack, MODEL, batch=4, step_s=0.02, start_file=str(loaded)),),
        kwargs={"name": APP, "route_prefix": PREFIX})
    deploy.start()
    try:
        # The router is up and lists the model (from its config) while the engine loads ...
        wait_until(lambda: _status(f"{base}/v1/models", stack["headers"]) == 200, 120, 0.2)
        # ... and /ready says so, without a key, naming no model; once its feed has polled too.
        for _ in range(5):
            r = httpx.get(f"{base}/ready", timeout=5)
            assert (r.status_code, r.json(), r.headers.get("retry-after")) == (
                503, {"status": "loading", "models": 1, "models_loading": 1}, "1"), r.text
        assert not is_ready(base) and deploy.is_alive()
        loaded.touch()  # the model has loaded: the replica's constructor returns
        wait_until_serving(base, timeout_s=120, interval_s=0.2)
        r = httpx.get(f"{base}/ready", timeout=5)
        assert r.json() == {"status": "ready", "models": 1, "models_loading": 0}
        r = httpx.post(f"{base}/v1/completions", headers=stack["headers"], timeout=60,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        deploy.join(timeout=60)  # Serve saw the app running too
        assert not deploy.is_alive()
    finally:
        loaded.touch()  # a failed check must not leave serve.run waiting on the replica
        deploy.join(timeout=60)
        serve.delete(APP)
