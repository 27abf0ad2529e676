"""OpenTelemetry tracing (serve_app/observability/tracing.py), without Ray: the SDK's
in-memory exporter stands in for the OTLP collector."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from opentelemetry.sdk import trace as sdk_trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from serve_app.config import TracingSettings, parse_config
from serve_app.engine.protocol import GenerationRequest, SamplingOptions
from serve_app.observability import tracing

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
KEY = "sk-secret-key-never-in-a-span"
PROMPT = "the secret prompt text"


@pytest.fixture
def exported():
    exporter = InMemorySpanExporter()
    assert tracing.configure(TracingSettings(enabled=True), "router", env={},
                             exporter=exporter)
    yield exporter
    tracing.configure(None, "router", env={})


@pytest.fixture
def sdk_spans(monkeypatch):
    """Counts the SDK span objects made."""
    made = []
    init = sdk_trace.Span.__init__

    def counting(self, *args, **kwargs):
        made.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(sdk_trace.Span, "__init__", counting)
    return made


def first_chunk(timing=None):
    return SimpleNamespace(prompt_tokens=7, replica="r1", timing=timing or {
        "replica": 5.0, "tokenize": 1.0, "engine_queue": 2.0, "prefill": 3.0,
        "to_replica": 0.5, "cached_tokens": 4.0, "_entered": 1.0})


def one_request(headers: dict[str, str]) -> dict[str, str]:
    """The router's calls for one request that completes; returns the engine's carrier."""
    async def run() -> dict[str, str]:
        rt = tracing.start_request(headers)

        async def authenticate():
            return SimpleNamespace(name="team-a", priority="high")

        async def nothing():
            return None

        tenant = await rt.authenticate(authenticate())
        rt.request(tenant, "tiny-llama", "cmpl-abc")
        await tracing.current().phase("quota", nothing())
        await tracing.current().phase("queue", nothing(), band="high")
        carrier = tracing.current().dispatch()
        tracing.current().first_chunk(first_chunk())
        rt.finish(200, 7, 3, 4)
        return carrier

    return asyncio.run(run())


def by_name(exporter):
    return {s.name: s for s in exporter.get_finished_spans()}


def test_off_makes_no_span(sdk_spans):
    assert not tracing.configure(TracingSettings(), "router", env={})
    assert tracing.start_request({"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}) \
        is tracing.NO_TRACE
    assert one_request({}) is None  # NO_TRACE's dispatch: no carrier for the engine
    request = GenerationRequest("r", SamplingOptions(), prompt="x",
                                trace_context={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    span = tracing.engine_span(request)
    tracing.engine_first(span, first_chunk())
    tracing.engine_end(span, False)
    assert span is None and sdk_spans == []
    assert tracing.configure(TracingSettings(enabled=False), "router",
                             env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}) is False


def test_on_from_the_environment():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}
    assert TracingSettings().active(env) and not TracingSettings().active({})
    assert TracingSettings(endpoint="http://c:4318").active({})


def test_client_traceparent_is_continued(exported):
    carrier = one_request({"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    spans = by_name(exported)
    assert set(spans) == {"serve_app.request", "authenticate", "quota", "queue", "dispatch"}
    server = spans["serve_app.request"]
    assert {format(s.context.trace_id, "032x") for s in spans.values()} == {TRACE_ID}
    assert format(server.parent.span_id, "016x") == PARENT_ID and server.parent.is_remote
    dispatch = spans["dispatch"]
    assert carrier["traceparent"] == \
        f"00-{TRACE_ID}-{format(dispatch.context.span_id, '016x')}-01"
    attrs = server.attributes
    assert attrs["serve_app.tenant"] == "team-a" and attrs["serve_app.model"] == "tiny-llama"
    assert attrs["serve_app.priority"] == "high"
    assert attrs["http.response.header.x-request-id"] == "cmpl-abc"
    assert attrs["http.response.status_code"] == 200 and attrs["serve_app.cached_tokens"] == 4
    assert (attrs["serve_app.prompt_tokens"], attrs["serve_app.completion_tokens"]) == (7, 3)
    assert spans["queue"].attributes["band"] == "high"
    assert [e.name for e in server.events] == ["first_token", "end"]


def test_without_traceparent_a_trace_starts_at_the_router(exported):
    one_request({})
    server = by_name(exported)["serve_app.request"]
    assert server.parent is None and format(server.context.trace_id, "032x") != TRACE_ID


def test_engine_span_joins_the_routers_trace(exported):
    carrier = one_request({"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    dispatch_id = by_name(exported)["dispatch"].context.span_id
    exported.clear()
    request = GenerationRequest("cmpl-abc", SamplingOptions(), prompt=PROMPT,
                                trace_context=carrier)
    span = tracing.engine_span(request)
    assert request.trace_context != carrier  # vLLM gets the engine span's own context
    tracing.engine_first(span, first_chunk())
    tracing.engine_end(span, False)
    spans = by_name(exported)
    assert set(spans) == {"engine.generate", "engine_queue", "prefill", "decode"}
    engine = spans["engine.generate"]
    assert engine.parent.span_id == dispatch_id
    assert request.trace_context["traceparent"].split("-")[2] == \
        format(engine.context.span_id, "016x")
    assert spans["prefill"].end_time - spans["prefill"].start_time == pytest.approx(3e6, 1e5)
    assert engine.attributes["serve_app.timing.prefill"] == 3.0


@pytest.mark.parametrize("headers", [{}, {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-00"}])
def test_sampling_zero_exports_nothing(headers):
    exporter = InMemorySpanExporter()
    tracing.configure(TracingSettings(enabled=True, sample_ratio=0.0), "router", env={},
                      exporter=exporter)
    try:
        assert tracing.start_request(headers).recording is False  # its extras are skipped
        carrier = one_request(headers)
        request = GenerationRequest("r", SamplingOptions(), prompt="x", trace_context=carrier)
        span = tracing.engine_span(request)
        tracing.engine_first(span, first_chunk())
        tracing.engine_end(span, False)
        assert exporter.get_finished_spans() == ()
        # Parent-based: a client's sampled trace is followed whatever the ratio.
        assert tracing.start_request({"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
                                     ).recording is True
        one_request({"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
        assert len(exporter.get_finished_spans()) == 5
    finally:
        tracing.configure(None, "router", env={})


def test_no_attribute_holds_a_key_or_prompt(exported):
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01",
               "authorization": f"Bearer {KEY}", "x-prompt": PROMPT}

    async def refused():
        rt = tracing.start_request(headers)

        async def bad_key():
            raise RuntimeError(f"refused {KEY}")  # even an error's message stays out

        with pytest.raises(RuntimeError):
            await rt.authenticate(bad_key())

    asyncio.run(refused())
    carrier = one_request(headers)
    request = GenerationRequest("r", SamplingOptions(), prompt=PROMPT, trace_context=carrier)
    span = tracing.engine_span(request)
    tracing.engine_first(span, first_chunk())
    tracing.engine_end(span, False)
    spans = exported.get_finished_spans()
    assert len(spans) > 6
    for s in spans:
        values = [str(v) for v in s.attributes.values()] + [
            str(v) for e in s.events for v in e.attributes.values()] + [s.name]
        assert not any(KEY in v or PROMPT in v for v in values), s.name


def test_replica_env_carries_the_config():
    cfg = parse_config({"models": [{"name": "m", "path": "p", "engine_env": {"A": "1"}}],
                        "router": {"tracing": {"endpoint": "http://collector:4318",
                                               "sample_ratio": 0.1}}})
    env = tracing.with_replica_env(cfg, env={"OTEL_RESOURCE_ATTRIBUTES": "k=v", "HOME": "/"}
                                   ).models[0].engine_env
    assert env == {"A": "1", "OTEL_RESOURCE_ATTRIBUTES": "k=v",
                   "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces",
                   "OTEL_TRACES_SAMPLER_ARG": "0.1", "OTEL_SERVICE_NAME": "serve-app"}
    settings = tracing.settings_from_env(env)
    assert settings.active(env) and tracing.sample_ratio(settings, env) == 0.1
    assert tracing.sample_ratio(TracingSettings(), {}) == 1.0
    assert tracing.sample_ratio(TracingSettings(), {"OTEL_TRACES_SAMPLER_ARG": "0.25"}) == 0.25
    plain = parse_config({"models": [{"name": "m", "path": "p"}]})
    assert tracing.with_replica_env(plain, env={}) is plain
    off = parse_config({"models": [{"name": "m", "path": "p"}],
                        "router": {"tracing": {"enabled": False}}})
    env = tracing.with_replica_env(off, env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}
                                   ).models[0].engine_env
    assert not tracing.settings_from_env(env).active(env)
