"""OpenTelemetry traces of each request: the one home of tracing (docs/operations.md#traces).

Off by default, and then free: no tracer provider exists, :func:`start_request` hands back
:data:`NO_TRACE` (whose methods do nothing) and no span object is made. On (``router.tracing``,
or ``OTEL_EXPORTER_OTLP_ENDPOINT`` in the environment: :meth:`TracingSettings.active`) each
process that serves requests keeps one tracer provider with parent-based ratio sampling and a
batch processor exporting OTLP over HTTP/protobuf.

* **Router** (:class:`RequestTrace`, made by :func:`start_request`): one server span per request,
  continuing the client's W3C ``traceparent`` (a new trace without one), with child spans
  ``authenticate``, ``quota``, ``queue`` (band, and the requests already waiting when it
  joined: in all bands and in its own) and ``dispatch`` (admission -> first chunk),
  events ``first_token`` and ``end``; attributes tenant, model, band, ``x-request-id``, prompt,
  output and cached tokens, the HTTP status and the OpenAI error code. The dispatch span's
  context travels to the engine replica in ``GenerationRequest.trace_context``.
* **Engine replica** (:func:`engine_span`): a span under the router's dispatch span from the
  replica's intake to the request's end, with ``engine_queue`` and ``prefill`` child spans from
  the replica's Server-Timing phases (:mod:`serve_app.engine.timing`) and ``decode`` after the
  first token; its own context goes on to vLLM as ``trace_headers`` (vLLM's spans, where its
  tracing is on, join the trace).

Attributes are names and counts only: never a prompt, an output or a key.
"""

from __future__ import annotations

import contextvars
import os
import time
from typing import Any, Awaitable, Mapping, TypeVar

from opentelemetry import trace
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from serve_app.config import AppConfig, TracingSettings

T = TypeVar("T")

# Set in an engine replica's environment by with_replica_env: "1"/"0" for a config's explicit
# `enabled` (the OTEL_* variables carry the rest).
ENABLED_ENV = "SERVE_APP_TRACING"
TRACES_PATH = "/v1/traces"

_PROPAGATOR = TraceContextTextMapPropagator()
_tracer: trace.Tracer | None = None  # None: tracing is off in this process
_provider: Any = None


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a collector address (``/v1/traces`` added unless given)."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith(TRACES_PATH) else endpoint + TRACES_PATH


def configure(settings: TracingSettings | None, component: str,
              env: Mapping[str, str] | None = None, exporter: Any = None) -> bool:
    """Set up (or tear down) this process's tracing for ``component`` (``router`` | ``engine``);
    returns whether it is on. ``exporter`` replaces the OTLP exporter, exported synchronously
    (unit tests: the SDK's InMemorySpanExporter)."""
    global _tracer, _provider
    env = os.environ if env is None else env
    settings = settings or TracingSettings()
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None
    if not settings.active(dict(env)):
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    provider = TracerProvider(
        sampler=ParentBased(TraceIdRatioBased(sample_ratio(settings, env))),
        resource=Resource.create({"service.name": settings.service_name,
                                  "serve_app.component": component}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        url = traces_url(settings.endpoint) if settings.endpoint else None
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
    _provider, _tracer = provider, provider.get_tracer("serve_app")
    return True


def sample_ratio(settings: TracingSettings, env: Mapping[str, str]) -> float:
    """The share of new traces kept: the config's, else ``OTEL_TRACES_SAMPLER_ARG``, else 1."""
    if settings.sample_ratio is not None:
        return settings.sample_ratio
    try:
        return min(1.0, max(0.0, float(env.get("OTEL_TRACES_SAMPLER_ARG", "1"))))
    except ValueError:
        return 1.0


def settings_from_env(env: Mapping[str, str] | None = None) -> TracingSettings:
    """An engine replica's tracing settings, from the environment :func:`replica_env` gave it
    (or the operator's ``OTEL_*`` variables)."""
    env = os.environ if env is None else env
    flag = env.get(ENABLED_ENV)
    return TracingSettings(enabled=None if flag is None else flag == "1",
                           service_name=env.get("OTEL_SERVICE_NAME", "serve-app"))


def replica_env(settings: TracingSettings, env: Mapping[str, str] | None = None
                ) -> dict[str, str]:
    """The environment that makes an engine replica trace as ``settings`` say: the launching
    process's ``OTEL_*`` variables, the config's endpoint, ratio and service name."""
    env = os.environ if env is None else env
    out = {k: v for k, v in env.items() if k.startswith("OTEL_")}
    if settings.enabled is not None:
        out[ENABLED_ENV] = "1" if settings.enabled else "0"
    if settings.endpoint:
        out["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = traces_url(settings.endpoint)
    if settings.active(dict(env)):
        out["OTEL_TRACES_SAMPLER_ARG"] = repr(sample_ratio(settings, env))
        out["OTEL_SERVICE_NAME"] = settings.service_name
    return out


def with_replica_env(config: AppConfig, env: Mapping[str, str] | None = None) -> AppConfig:
    """``config`` with :func:`replica_env` in every model's ``engine_env`` (a model's own
    values win); unchanged when there is nothing to pass on."""
    extra = replica_env(config.router.tracing, env)
    if not extra:
        return config
    return config.model_copy(update={"models": [
        m.model_copy(update={"engine_env": {**extra, **m.engine_env}}) for m in config.models]})


def _epoch_ns(mono: float) -> int:
    """A ``time.monotonic()`` reading as the wall-clock nanoseconds spans carry."""
    return time.time_ns() - int((time.monotonic() - mono) * 1e9)


def carrier_of(span: Any) -> dict[str, str]:
    """The W3C ``traceparent``/``tracestate`` headers of ``span``'s context."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


class _NoTrace:
    """A request's trace while tracing is off: every method does nothing."""

    recording = False  # attributes worth computing only for a recorded span are skipped

    async def authenticate(self, awaitable: Awaitable[T]) -> T:
        return await awaitable

    async def phase(self, name: str, awaitable: Awaitable[T], **attrs: Any) -> T:
        return await awaitable

    def request(self, tenant: Any, model: str, request_id: str) -> None:
        pass

    def dispatch(self) -> dict[str, str] | None:
        return None

    def first_chunk(self, first: Any) -> None:
        pass

    def error(self, err: Exception) -> None:
        pass

    def finish(self, status: int, prompt: int = 0, completion: int = 0,
               cached: int | None = None) -> None:
        pass


NO_TRACE = _NoTrace()
_CURRENT: contextvars.ContextVar[Any] = contextvars.ContextVar("serve_app_trace",
                                                               default=NO_TRACE)


def current() -> RequestTrace | _NoTrace:
    """The trace of the request this task serves (:data:`NO_TRACE` when off)."""
    return _CURRENT.get()


def start_request(headers: Mapping[str, str]) -> RequestTrace | _NoTrace:
    """Open the router's span of a request with ``headers`` (its client's ``traceparent``
    continued) and make it this task's :func:`current`; :data:`NO_TRACE` while off."""
    if _tracer is None:
        return NO_TRACE
    parent = _PROPAGATOR.extract(headers)
    rt = RequestTrace(_tracer.start_span("serve_app.request", context=parent,
                                         kind=SpanKind.SERVER))
    _CURRENT.set(rt)
    return rt


class RequestTrace:
    """One request's spans in the router (see the module docstring)."""

    def __init__(self, span: Any) -> None:
        self.span = span
        self.recording: bool = span.is_recording()  # False: not sampled
        self.context = trace.set_span_in_context(span)
        self.dispatched: Any = None
        self.ended = False

    def _child(self, name: str, start: float, error: BaseException | None = None,
               **attrs: Any) -> None:
        assert _tracer is not None
        span = _tracer.start_span(name, context=self.context, start_time=_epoch_ns(start),
                                  attributes=attrs)
        if error is not None:
            span.set_attribute("error.type", type(error).__name__)
        span.end()

    async def authenticate(self, awaitable: Awaitable[T]) -> T:
        """Await the key's tenant; a refused key (401) ends the request's span here."""
        start = time.monotonic()
        try:
            tenant = await awaitable
        except BaseException as err:
            self._child("authenticate", start, err)
            self.error(err)
            self.finish(getattr(err, "status_code", 500))
            raise
        self._child("authenticate", start)
        return tenant

    async def phase(self, name: str, awaitable: Awaitable[T], **attrs: Any) -> T:
        """Await ``awaitable`` as child span ``name`` (``quota``, ``queue``)."""
        start, error = time.monotonic(), None
        try:
            return await awaitable
        except BaseException as err:
            error = err
            raise
        finally:
            self._child(name, start, error, **attrs)

    def request(self, tenant: Any, model: str, request_id: str) -> None:
        self.span.set_attributes({"serve_app.tenant": tenant.name, "serve_app.model": model,
                                  "serve_app.priority": tenant.priority,
                                  "http.response.header.x-request-id": request_id})

    def dispatch(self) -> dict[str, str]:
        """Open the dispatch span; returns its context for the engine replica."""
        assert _tracer is not None
        self.dispatched = _tracer.start_span("dispatch", context=self.context,
                                             kind=SpanKind.CLIENT)
        return carrier_of(self.dispatched)

    def first_chunk(self, first: Any) -> None:
        """The first chunk is back: the dispatch span ends, with the engine's phases."""
        self.span.add_event("first_token")
        self.span.set_attribute("serve_app.prompt_tokens", first.prompt_tokens)
        if self.dispatched is not None:
            self.dispatched.set_attribute("serve_app.replica", first.replica or "")
            for name, ms in (first.timing or {}).items():
                if not name.startswith("_"):
                    self.dispatched.set_attribute(f"serve_app.timing.{name}", ms)
            self.dispatched.end()
            self.dispatched = None

    def error(self, err: BaseException) -> None:
        """The OpenAI error code of a refused request (``rate_limit_exceeded``, ...)."""
        code = getattr(err, "code", None)
        if code:
            self.span.set_attribute("serve_app.error_code", str(code))

    def finish(self, status: int, prompt: int = 0, completion: int = 0,
               cached: int | None = None) -> None:
        """End the request's spans once, however it ended (499: the client left)."""
        if self.ended:
            return
        self.ended = True
        if self.dispatched is not None:  # no first chunk came
            self.dispatched.end()
        self.span.set_attributes({"http.response.status_code": status,
                                  "serve_app.prompt_tokens": prompt,
                                  "serve_app.completion_tokens": completion})
        if cached is not None:
            self.span.set_attribute("serve_app.cached_tokens", cached)
        if status >= 500:
            self.span.set_status(trace.StatusCode.ERROR)
        self.span.add_event("end")
        self.span.end()


# -- the engine replica ---------------------------------------------------------------------
def engine_span(request: Any) -> Any | None:
    """Open the engine replica's span of ``request`` under the router's context (None while
    off or when the router sent none), and give ``request`` this span's context for vLLM."""
    if _tracer is None or not request.trace_context:
        return None
    span = _tracer.start_span("engine.generate", context=_PROPAGATOR.extract(
        request.trace_context), kind=SpanKind.SERVER, attributes={
        "serve_app.request_id": request.request_id, "serve_app.engine_priority":
        request.priority})
    if not span.is_recording():  # not sampled: vLLM gets the router's (unsampled) context
        return None
    request.trace_context = carrier_of(span)
    return span


def engine_first(span: Any | None, chunk: Any) -> None:
    """The engine's first output: ``engine_queue`` and ``prefill`` child spans from the
    replica's phases (ms, ending as the output reached the replica)."""
    if span is None:
        return
    assert _tracer is not None
    now = time.monotonic()
    span.add_event("first_token")
    span.set_attribute("serve_app.prompt_tokens", chunk.prompt_tokens)
    timing = chunk.timing or {}
    context = trace.set_span_in_context(span)
    end = now - timing.get("to_replica", 0.0) / 1000
    for name in ("prefill", "engine_queue"):  # backwards from the first token
        if name in timing:
            start = end - timing[name] / 1000
            child = _tracer.start_span(name, context=context, start_time=_epoch_ns(start))
            child.end(_epoch_ns(end))
            end = start
    for name, value in timing.items():
        if not name.startswith("_"):
            span.set_attribute(f"serve_app.timing.{name}", value)
    span.set_attribute("serve_app.first_token_at", _epoch_ns(now))


def engine_end(span: Any | None, no_output: bool) -> None:
    """The request left the engine: the ``decode`` child span (first token -> now), then the
    engine span ends."""
    if span is None:
        return
    assert _tracer is not None
    first_at = span.attributes.get("serve_app.first_token_at") if not no_output else None
    if first_at:
        decode = _tracer.start_span("decode", context=trace.set_span_in_context(span),
                                    start_time=first_at)
        decode.end()
    span.set_attribute("serve_app.first_output", not no_output)
    span.add_event("end")
    span.end()
