"""Tracing settings: OpenTelemetry spans of each request, exported over OTLP/HTTP."""

from __future__ import annotations

from pydantic import Field

from serve_app.config.base import _Strict


class TracingSettings(_Strict):
    """OpenTelemetry traces of each request: the router's spans (authenticate, quota, queue,
    dispatch, first token, end) and the engine replica's (intake, prefill, decode), exported
    over OTLP/HTTP (protobuf) with a batch processor (serve_app/observability/tracing.py;
    docs/operations.md#traces). Off, nothing is set up and no span is made."""

    enabled: bool | None = Field(
        None, description="true: trace; false: never (whatever the environment says); unset: "
        "trace when `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is "
        "set in the replica's environment (`serve-app run` passes `OTEL_*` on to every "
        "replica).")
    endpoint: str | None = Field(
        None, description="The collector's OTLP/HTTP address, e.g. `http://collector:4318` "
        "(`/v1/traces` is added unless given). Unset: `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, "
        "else `OTEL_EXPORTER_OTLP_ENDPOINT`, else the OTLP default (localhost:4318). Setting "
        "it turns tracing on unless `enabled: false`.")
    sample_ratio: float | None = Field(
        None, ge=0.0, le=1.0, description="Share of new traces kept (parent-based: a request "
        "whose client sent a sampled `traceparent` is always traced, an unsampled one never). "
        "Unset: `OTEL_TRACES_SAMPLER_ARG`, else 1.")
    service_name: str = Field(
        "serve-app", description="The spans' `service.name` (the router's and the engines' "
        "spans tell themselves apart by `serve_app.component`).")

    def active(self, env: dict[str, str]) -> bool:
        """Whether tracing is on, given the process environment ``env``."""
        if self.enabled is not None:
            return self.enabled
        return bool(self.endpoint or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                    or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
