"""A client that goes away mid-request stops the engine's work within a second or two."""

import time

import httpx
import pytest

from tests.integration.conftest import engine_load

pytestmark = pytest.mark.integration


def _wait_idle(stack, seconds: float) -> dict[str, int]:
    deadline = time.time() + seconds
    load = engine_load(stack)
    while time.time() < deadline and (load["running"] or load["unfinished"]):
        time.sleep(0.1)
        load = engine_load(stack)
    return load


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "long story"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "talk forever"}]}),
])
def test_stream_disconnect_aborts_engine_request(stack, path, body):
    payload = {"model": stack["model"], "max_tokens": 1900, "ignore_eos": True, "stream": True,
               "n": 4, **body}
    with httpx.Client(base_url=stack["base"], timeout=60, headers=stack["headers"]) as c:
        with c.stream("POST", path, json=payload) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            seen = 0
            for line in lines:
                if line.startswith("data: "):
                    seen += 1
                if seen >= 3:
                    break
            # The engine is busy with our request right now ...
            assert engine_load(stack)["unfinished"] >= 1
        # ... and leaving the `with` closed the connection mid-stream.
    t0 = time.time()
    load = _wait_idle(stack, 5)
    assert load["unfinished"] == 0 and load["running"] == 0, load
    assert time.time() - t0 < 2.5


@pytest.mark.xfail(strict=False, reason=(
    "Known gap under Ray Serve's HAProxy + direct-ingress data plane (router.high_throughput, "
    "the default): the client's disconnect of a request that has not started its response is "
    "often not delivered to the router replica (measured: 7 of 12 repeats left the engine "
    "running; 12 of 12 aborted within 0.12 s on Serve's Python proxy). Streams are aborted "
    "reliably (tests above). See the session note; fix or report upstream."))
def test_non_streaming_disconnect_aborts_engine_request(stack):
    # n=4 x 1900 tokens takes far longer than the test waits, so finishing naturally cannot
    # pass for an abort.
    payload = {"model": stack["model"], "prompt": "x", "max_tokens": 1900, "ignore_eos": True,
               "n": 4}
    with httpx.Client(base_url=stack["base"], timeout=1.5, headers=stack["headers"]) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json=payload)
    load = _wait_idle(stack, 5)
    assert load["unfinished"] == 0 and load["running"] == 0, load


def test_service_answers_after_disconnects(client, stack):
    r = client.post("/v1/completions", json={"model": stack["model"], "prompt": "ok",
                                              "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
