"""OpenTelemetry traces end to end (issue 40): an app with tracing on beside the shared stack
exports to a real OTLP/HTTP receiver started here, which decodes the protobuf requests.

The app samples new traces at ratio 0: a client's sampled ``traceparent`` is still followed
(parent-based), so every request here that sends one is traced and every other one must export
nothing (checked last, behind a sampled request exported after them)."""

from __future__ import annotations

import os

import httpx
import pytest

from serve_app.launch import wait_until_serving

from .conftest import DEFAULT_TENANT, wait_until
from .otlp_receiver import Receiver

APP, PREFIX, MODEL = "tracing", "/tracing", "traced-model"
MARKER = "zebra-quartz-prompt-marker"  # prompt text no span may hold
SENT: set[str] = set()  # trace ids this module sent sampled


@pytest.fixture(scope="module")
def traced(stack):
    """The receiver and the base URL of an app with tracing on (its engine the scripted one,
    behind a real LLMServer) and a tenant allowed one request a minute (its key)."""
    from ray import serve

    from serve_app.app import build_app
    from serve_app.config import ModelSettings, TenantSettings
    from serve_app.engine.scripted import SCRIPTED_ENGINE_CLASS
    from serve_app.governance.keys import key_digest, new_key
    from serve_app.observability import tracing

    receiver = Receiver()
    key = new_key()
    cfg = stack["config"]
    router = cfg.router.model_copy(update={"tracing": cfg.router.tracing.model_copy(
        update={"endpoint": receiver.url, "sample_ratio": 0.0})})
    model = ModelSettings(name=MODEL, path=str(stack["path"]), device="cpu", max_model_len=2048,
                          engine_kwargs={"max_num_seqs": 8, "scripted_step_s": 0.02})
    limited = TenantSettings(name="tracing-rpm", api_key_sha256=[key_digest(key)],
                             requests_per_minute=1)
    cfg = cfg.model_copy(update={"router": router, "models": [model],
                                 "tenants": [*cfg.tenants, limited]})
    # The engine replicas learn the endpoint through their environment, as with serve-app run
    # (this process's own OTEL_* variables left out).
    serve.run(build_app(tracing.with_replica_env(cfg, env={}), SCRIPTED_ENGINE_CLASS),
              name=APP, route_prefix=PREFIX, blocking=False)
    base = stack["base"] + PREFIX
    wait_until_serving(base, timeout_s=120, interval_s=0.2)
    try:
        yield receiver, base, key
    finally:
        serve.delete(APP)
        receiver.server.shutdown()


def traceparent(sampled: bool = True) -> tuple[str, str]:
    trace_id, parent = os.urandom(16).hex(), os.urandom(8).hex()
    if sampled:
        SENT.add(trace_id)
    return trace_id, f"00-{trace_id}-{parent}-{'01' if sampled else '00'}"


def body(max_tokens: int = 8, stream: bool = False) -> dict:
    return {"model": MODEL, "prompt": f"{MARKER} tell me a story", "max_tokens": max_tokens,
            "stream": stream}


def spans_of(receiver: Receiver, trace_id: str, status: int, engine: bool = True
             ) -> dict[str, dict]:
    """The trace's spans by name once the router's request span with ``status`` (and, with
    ``engine``, the engine replica's span) arrived."""
    def arrived():
        spans = {s["name"]: s for s in receiver.of(trace_id)}
        request = spans.get("serve_app.request")
        if request is None or request["attributes"].get("http.response.status_code") != status:
            return None
        return spans if not engine or "engine.generate" in spans else None

    return wait_until(arrived, 30, 0.1)


def assert_nothing_secret(receiver: Receiver, *secrets: str) -> None:
    with receiver.lock:
        spans = list(receiver.spans)
    for s in spans:
        for value in [s["name"], *map(str, s["attributes"].values())]:
            assert not any(secret in value for secret in secrets), (s["name"], value)


def test_a_request_is_traced_from_the_router_to_the_engine(traced, stack):
    receiver, base, _ = traced
    trace_id, header = traceparent()
    r = httpx.post(f"{base}/v1/completions", json=body(), timeout=60,
                   headers={**stack["headers"], "traceparent": header})
    assert r.status_code == 200, r.text
    spans = spans_of(receiver, trace_id, 200)
    request, engine, dispatch = (spans["serve_app.request"], spans["engine.generate"],
                                 spans["dispatch"])
    assert request["parent"] == header.split("-")[2]  # the client's span is continued
    assert request["component"] == "router" and engine["component"] == "engine"
    assert {"authenticate", "quota", "queue", "dispatch", "decode"} <= set(spans)
    assert engine["parent"] == dispatch["span_id"]  # the context crossed to the replica
    queue = spans["queue"]["attributes"]  # nothing waited ahead of this request
    assert (queue["serve_app.queue.ahead"], queue["serve_app.queue.ahead_in_band"]) == (0, 0)
    attrs = request["attributes"]
    # The response's X-Request-Id is the router's id (Serve appends its own after it).
    request_id = r.headers["x-request-id"].split(",")[0]
    assert attrs["http.response.header.x-request-id"] == request_id
    assert attrs["serve_app.tenant"] == DEFAULT_TENANT
    assert attrs["serve_app.model"] == MODEL and attrs["serve_app.priority"]
    usage = r.json()["usage"]
    assert attrs["serve_app.prompt_tokens"] == usage["prompt_tokens"]
    assert attrs["serve_app.completion_tokens"] == usage["completion_tokens"] > 0
    assert request["events"] == ["first_token", "end"]
    assert engine["attributes"]["serve_app.request_id"] == request_id
    assert_nothing_secret(receiver, MARKER, stack["key"], r.json()["choices"][0]["text"])


def test_a_429_and_a_client_that_leaves_have_their_status(traced, stack):
    receiver, base, key = traced
    headers = {"Authorization": f"Bearer {key}"}
    first_id, first = traceparent()
    assert httpx.post(f"{base}/v1/completions", json=body(), timeout=60,
                      headers={**headers, "traceparent": first}).status_code == 200
    refused_id, refused = traceparent()
    r = httpx.post(f"{base}/v1/completions", json=body(), timeout=60,
                   headers={**headers, "traceparent": refused})
    assert r.status_code == 429, r.text
    spans = spans_of(receiver, refused_id, 429, engine=False)
    attrs = spans["serve_app.request"]["attributes"]
    assert attrs["serve_app.error_code"] == r.json()["error"]["code"] == "rate_limit_exceeded"
    assert attrs["serve_app.tenant"] == "tracing-rpm" and "engine.generate" not in spans

    gone_id, gone = traceparent()
    with httpx.stream("POST", f"{base}/v1/completions", json=body(400, stream=True),
                      timeout=60, headers={**stack["headers"], "traceparent": gone}) as s:
        assert s.status_code == 200
        next(s.iter_lines())  # the first event, then the client leaves
    spans = spans_of(receiver, gone_id, 499)
    assert spans["serve_app.request"]["attributes"]["serve_app.completion_tokens"] < 400
    assert spans["engine.generate"]["attributes"]["serve_app.first_output"] is True
    assert_nothing_secret(receiver, MARKER, key, stack["key"])


def test_sampling_zero_exports_nothing(traced, stack):
    """Requests without a sampled parent (none, or an unsampled one) export nothing: a sampled
    request sent after them reaches the receiver from both replicas, and nothing else did."""
    receiver, base, _ = traced
    for header in (None, traceparent(sampled=False)[1]):
        extra = {"traceparent": header} if header else {}
        r = httpx.post(f"{base}/v1/completions", json=body(), timeout=60,
                       headers={**stack["headers"], **extra})
        assert r.status_code == 200, r.text
    trace_id, header = traceparent()
    assert httpx.post(f"{base}/v1/completions", json=body(), timeout=60,
                      headers={**stack["headers"], "traceparent": header}).status_code == 200
    spans_of(receiver, trace_id, 200)  # from the router and the engine replica
    with receiver.lock:
        unexpected = {s["trace_id"] for s in receiver.spans} - SENT
    assert not unexpected, f"spans of unsampled requests: {unexpected}"
