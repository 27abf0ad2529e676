"""A client that goes away mid-request stops the engine's work within a second or two."""

import asyncio
import time

import httpx
import pytest

from tests.integration.conftest import engine_load

pytestmark = pytest.mark.integration


def _wait_idle(stack, seconds: float):
    deadline = time.time() + seconds
    load = engine_load(stack)
    while time.time() < deadline and (load.running or load.unfinished):
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
            assert engine_load(stack).unfinished >= 1
        # ... and leaving the `with` closed the connection mid-stream.
    t0 = time.time()
    load = _wait_idle(stack, 5)
    assert load.unfinished == 0 and load.running == 0, load
    assert time.time() - t0 < 2.5


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "x"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
])
def test_non_streaming_disconnect_aborts_engine_request_regression_haproxy_splice(
        stack, path, body):
    """Regression: under the HAProxy data plane this failed 7 of 12 times (the engine ran on to
    max_tokens): HAProxy's splice-request hid the close of a client whose body came in its own
    packet, as httpx sends it (serve_app/ingress/haproxy.py). Five tries each, all strict."""
    # n=4 x 1900 tokens takes far longer than the test waits, so finishing naturally cannot
    # pass for an abort.
    payload = {"model": stack["model"], "max_tokens": 1900, "ignore_eos": True, "n": 4, **body}
    for attempt in range(5):
        with httpx.Client(base_url=stack["base"], timeout=1.5, headers=stack["headers"]) as c:
            with pytest.raises(httpx.ReadTimeout):
                c.post(path, json=payload)
        t0 = time.time()
        load = _wait_idle(stack, 5)
        assert load.unfinished == 0 and load.running == 0, (attempt, load)
        assert time.time() - t0 < 2.0, attempt


def test_service_answers_after_disconnects(client, stack):
    r = client.post("/v1/completions", json={"model": stack["model"], "prompt": "ok",
                                              "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_queued_clients_that_leave_free_their_places_at_once(stack):
    """Twenty clients waiting in the router's queue go away: within 2 s the queue holds none of
    them and the one that had got in (a tenant's first request) no longer holds a slot."""
    from .conftest import IN_FLIGHT, admission_state, wait_until

    async def main() -> tuple[float, dict, list]:
        headers_a = {"Authorization": f"Bearer {stack['keys']['team-a']}"}
        headers_c = {"Authorization": f"Bearer {stack['keys']['team-c']}"}
        body = {"model": stack["model"], "prompt": "x", "max_tokens": 600, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=stack["base"], timeout=600) as client:
            flood = [asyncio.create_task(client.post("/v1/completions", json={
                **body, "stream": True}, headers=headers_a)) for _ in range(IN_FLIGHT + 5)]
            # The engine is full and the rest of the flood waits, every flood request counted
            # (a base taken before the last one arrived made its arrival look like a leaving
            # client still queued: regression of a failure at 3.1 s, trace in the message).
            base = await asyncio.to_thread(
                wait_until, lambda: (s := admission_state(stack))["in_flight"] >= IN_FLIGHT
                and s["in_flight"] + s["queued"] >= len(flood) and s, 60)
            # Streamed requests whose response has not started: only the router's own watch of
            # the connection can notice them leave (this failed before the HAProxy fix).
            leaving = [asyncio.create_task(client.post("/v1/completions", json={
                **body, "stream": True}, headers=headers_c)) for _ in range(20)]
            seen: list = []
            try:
                await asyncio.to_thread(
                    wait_until, lambda: seen.append(admission_state(stack)) or
                    seen[-1]["queued"] >= base["queued"] + 18, 30)
            except AssertionError:
                raise AssertionError(f"base {base}, now {seen[-1]}, "
                                     f"{[t for t in leaving if t.done()][:1]}") from None
            for task in leaving:
                task.cancel()
            t0 = time.monotonic()
            await asyncio.gather(*leaving, return_exceptions=True)
            # Their queue places and the engine place the first of them got (a tenant's first
            # request goes in at capacity) are free; counted per tenant, since the flood's own
            # requests may move from the queue into the engines meanwhile.
            trace: list = []

            def freed() -> bool:
                s = admission_state(stack)
                trace.append((round(time.monotonic() - t0, 2), s["queued"],
                              s["in_flight_by_tenant"], s["engine_running"], s["engine_waiting"]))
                return s["queued"] <= base["queued"] and not s["in_flight_by_tenant"].get("team-c")

            await asyncio.to_thread(wait_until, freed, 10, 0.02)
            elapsed = time.monotonic() - t0
            for task in flood:
                task.cancel()
            await asyncio.gather(*flood, return_exceptions=True)
        return elapsed, base, trace

    elapsed, base, trace = asyncio.run(main())
    # (seconds, queued, in flight by tenant, engine running, engine waiting) every ~0.1 s
    assert elapsed < 2.0, (f"queued clients' places were freed after {elapsed:.2f} s; "
                           f"before: {base}; after the clients left: {trace[::5]}")
    load = _wait_idle(stack, 10)
    assert load.unfinished == 0 and load.running == 0, load
