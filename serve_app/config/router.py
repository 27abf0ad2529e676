"""The router's section: its HTTP surface, admission, queues and data plane."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from serve_app.config.base import _Strict
from serve_app.config.observability import TracingSettings


class AdmissionSettings(_Strict):
    """When the router releases a queued request to a model's engines (serve_app/admission/)."""

    policy: Literal["engine_feedback", "fixed"] = Field(
        "engine_feedback", description="`engine_feedback`: release requests only while the "
        "engines start what they are sent (their waiting queues stay within `headroom`), so "
        "the backlog waits in the router's fair queue and capacity follows the live replicas. "
        "`fixed`: the model's max_ongoing_requests per live replica (the baseline).",
    )
    headroom: int = Field(
        4, ge=1, description="Requests per replica the router lets wait inside an engine, so "
        "it always has work to start at its next step (at least one step's worth of prompts: "
        "max_num_batched_tokens / recent prompt length). Also how many first requests of "
        "tenants with nothing in flight may be out beyond capacity at once (each then starts "
        "at the engine's next step, ahead of queued floods, by its engine priority).",
    )
    batch_reserve: int = Field(
        0, ge=0, description="Places of a full engine batch (`max_num_seqs`) the backlog leaves "
        "free, with nothing of it waiting in the engine, for the first requests of idle tenants "
        "(at most `headroom` of them are let in beyond capacity): such a request then starts at "
        "the engine's next step instead of after a running request ends. Costs those places "
        "while only the backlog runs, so it pays where the batch binds and is small: the CPU "
        "configs set 2 of 64 (a quiet tenant's first token beside a flood: 224 -> 32 ms p50, "
        "bench/RESULTS.md 42a); on a GPU the KV cache or the token budget binds first.",
    )
    kv_cache_high: float = Field(
        0.95, gt=0, le=1, description="KV-cache use above which an engine counts as saturated: "
        "it gets what it runs, plus what its next step can start, plus `headroom` "
        "(docs/admission.md).",
    )
    poll_interval_s: float = Field(
        0.02, gt=0, description="How often the router reads the engines' load while it has "
        "requests in flight or queued (a broadcast of one small call to each replica).",
    )
    idle_poll_interval_s: float = Field(
        0.5, gt=0, description="The same when the model is idle (it also reports the router's "
        "backlog to the autoscaler).",
    )
    engine_polls_per_s: float = Field(
        50.0, gt=0, description="At most this many load polls a second reach each engine "
        "replica, over all router replicas: with N routers each polls every "
        "max(poll_interval_s, N / engine_polls_per_s), and at least every 0.1 s (fresher "
        "views matter more past 5 routers). A poll costs the replica's process about 1.5 ms "
        "of CPU in Serve's call path (bench/RESULTS.md 27b), beside vLLM's output handling on "
        "the same event loop.",
    )
    cold_start_timeout_s: float = Field(
        600.0, gt=0, description="A request waiting while its model has no live replica gets "
        "503 with Retry-After after this long: keep it above a replica's cold start (minutes "
        "on GPUs; 20-61 s for a CPU engine on 2 cores). A model whose replica cannot be placed "
        "at all (no node can hold it) gets its 503 at once instead.",
    )


class RouterSettings(_Strict):
    """The OpenAI ingress (router) deployment."""

    host: str = Field("127.0.0.1", description="Address the HTTP proxy binds.")
    port: int = Field(8000, ge=1, le=65535, description="Port of the OpenAI endpoint.")
    num_replicas: int = Field(1, ge=1, description="Router replicas (each is a FastAPI app).")
    resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources each router replica needs, "
        "e.g. {head: 0.01} with the head started with `--resources '{\"head\": 1}'`: keeps "
        "routers off the GPU nodes, so that losing one costs its engine replicas only, not every "
        "request that a router there was carrying.")
    max_ongoing_requests: int = Field(
        4096, ge=1, description="Requests one router replica holds at once."
    )
    max_body_bytes: int = Field(
        1_000_000, ge=1024, description="Larger request bodies get 413 before being parsed."
    )
    max_n: int = Field(16, ge=1, description="Largest `n` (choices per request) accepted.")
    max_in_flight_per_model: int | None = Field(
        None, ge=1, description="Upper bound on sequences of one model in its engines at once "
        "(a request counts its `n`), over all router replicas (None: no bound beyond "
        "`admission`, which follows the engines' live load). The rest wait in the router's "
        "fair queue.",
    )
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    budget_reserve_max_tokens: int = Field(
        512, ge=1, description="Completion tokens a request of a tenant with a `token_budget` "
        "reserves per choice at admission when it sets no `max_tokens` (chat requests often "
        "do not); one that sets it reserves exactly that. A request is admitted while the "
        "budget's spend plus the reservations in flight is below it, so concurrent requests "
        "spend at most the budget plus one reservation; one that generates past this guess "
        "can overshoot by the excess (serve_app/governance/budget.py).",
    )
    queue_policy: Literal["fair", "fifo"] = Field(
        "fair", description="Order of requests waiting in the router: `fair` (priority bands, "
        "then the least-served tenant) or `fifo` (arrival order; the baseline to compare with).",
    )
    max_queued_per_band: int = Field(
        4096, ge=0, description="Requests one priority band may hold waiting per model; "
        "beyond it new requests of that band get 429, but only for tenants holding at least "
        "their equal share of its waiting requests: one tenant's backlog cannot shut the band "
        "to the others (docs/admission.md).",
    )
    max_queued_per_tenant: int = Field(
        1024, ge=1, description="Requests one tenant may hold waiting per model (in each router "
        "replica, over all bands); beyond it that tenant's new requests get 429 and other "
        "tenants are unaffected. Bounds what a tenant flooding the endpoint, or held back by "
        "its `max_concurrent_requests`, keeps in the router: a band holds at most "
        "`max_queued_per_band` or, while several tenants wait in it, this bound for each of "
        "them. The default leaves most of a router replica's `max_ongoing_requests` to the "
        "other tenants.",
    )
    allow_open_endpoint: bool = Field(
        False, description="Serve a non-loopback `host` with no tenants (anyone who reaches "
        "the port uses the GPUs without a key). Refused unless set: add `tenants:` instead.",
    )
    stream_stall_timeout_s: float = Field(
        60.0, gt=0, description="A streamed response whose client accepts no bytes for this "
        "long is cut (status 408 in the tenant metrics) and its engine work aborted: a reader "
        "that stopped or trickles holds an admission slot, KV cache and router memory until "
        "then. Counted from a write the client did not take; the kernel's and HAProxy's "
        "buffers take a few MB of a stream first (bench/RESULTS.md section 9c). Waiting for "
        "the engine never counts.",
    )
    server_timing: bool = Field(
        False, description="Send a `Server-Timing` header on generation responses: the "
        "request's router queue wait, the hop to its replica and the engine's phases up to "
        "its first token, in ms (see serve_app/engine/timing.py). Off by default: the engine "
        "queue times it shows reflect other tenants' load.",
    )
    tracing: TracingSettings = Field(
        default_factory=TracingSettings, description="OpenTelemetry traces of each request, "
        "the router's spans and the engine replicas' (off unless enabled here or by "
        "`OTEL_EXPORTER_OTLP_ENDPOINT`): docs/operations.md#traces.",
    )
    proxy_location: Literal["EveryNode", "HeadOnly"] = Field(
        "EveryNode", description="Where Serve runs its HTTP ingress (HAProxy): on every node "
        "(clients or a load balancer may reach any node) or on the head node only (one "
        "address; also the choice when several Ray nodes share one machine, whose ingresses "
        "would all bind `port`). Set when Serve first starts on a cluster.",
    )
    output_channels: bool = Field(
        True, description="Streamed chunks after a request's first travel from each engine "
        "replica to each router replica batched: one message per engine step instead of one "
        "per stream (serve_app/engine/channel.py). Off: one Serve stream message per chunk.",
    )
    high_throughput: bool = Field(
        True,
        description="Ray Serve's high-throughput data plane: HAProxy ingress instead of the "
        "Python HTTP proxy, gRPC between replicas, direct ingress. Set on every node before "
        "Ray starts (serve-app run does it for a local instance).",
    )
    haproxy_admin_host: str = Field(
        "127.0.0.1", description="Address HAProxy's stats page (no authentication) and its "
        "Prometheus exporter bind (serve_app/ingress/haproxy.py). Loopback by default; "
        "`0.0.0.0` (or one interface's address) opens them, e.g. for a Prometheus on another "
        "host. The OpenAI port is `host`.",
    )
    haproxy_stats_port: int = Field(
        8404, ge=1, le=65535, description="Port of HAProxy's stats page. Two stacks on one "
        "host need different ones.",
    )
    haproxy_metrics_port: int = Field(
        9101, ge=1, le=65535, description="Port of HAProxy's Prometheus exporter. Two stacks "
        "on one host need different ones.",
    )
    fallback_proxy_port: int = Field(
        8500, ge=1, le=65535, description="Port of Serve's fallback HTTP proxy on the head "
        "node (HAProxy sends requests there while no router replica is up), on `host`. Two "
        "stacks on one host need different ones.",
    )

    @field_validator("haproxy_admin_host")
    @classmethod
    def _admin_host(cls, value: str) -> str:
        if not re.fullmatch(r"[0-9A-Za-z.:*-]{1,253}", value):
            raise ValueError(f"{value!r} is not an IP address or host name; use e.g. "
                             "127.0.0.1 (the default) or 0.0.0.0")
        return value

    @model_validator(mode="after")
    def _distinct_ports(self) -> RouterSettings:
        ports = {"port": self.port, "haproxy_stats_port": self.haproxy_stats_port,
                 "haproxy_metrics_port": self.haproxy_metrics_port,
                 "fallback_proxy_port": self.fallback_proxy_port}
        seen: dict[int, str] = {}
        for name, port in ports.items():
            if port in seen:
                raise ValueError(f"router.{name} and router.{seen[port]} are both {port}; "
                                 "give each its own port")
            seen[port] = name
        return self

    @field_validator("resources")
    @classmethod
    def _custom_resources(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if name in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ValueError(f"router.resources: {name} is not a custom resource; a router "
                                 "reserves no CPU or GPU (leave it out)")
            if amount <= 0:
                raise ValueError(f"router.resources.{name}: {amount} must be > 0")
        return value


