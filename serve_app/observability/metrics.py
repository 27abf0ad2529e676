"""Every metric name the project reads or draws, in one table (data, not code).

Names are as Prometheus sees them when it scrapes Ray's metrics agents: Ray Serve's own metrics
and vLLM's engine metrics, which vLLM exports through Ray (``vllm:x`` becomes ``ray_vllm_x``).
Dashboards, tests and policies look names up here instead of spelling them again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Metric:
    name: str
    kind: Literal["counter", "gauge", "histogram"]
    source: Literal["serve", "vllm", "router"]
    help: str
    # Exported only by a model that serves LoRA adapters: the suite's default stack has no
    # series of it, so its panels are checked against the LoRA app (tests/integration/test_lora.py).
    adapters_only: bool = False


METRICS: dict[str, Metric] = {
    m.name: m
    for m in [
        Metric("ray_serve_num_http_requests_total", "counter", "serve",
               "HTTP requests answered by the ingress (router replica under direct ingress, else "
               "the Serve proxy), by status code."),
        Metric("ray_serve_num_http_error_requests_total", "counter", "serve",
               "HTTP requests answered with an error status, by route and code."),
        Metric("ray_serve_http_request_latency_ms", "histogram", "serve",
               "Whole-request HTTP latency at the ingress (to the last byte of a stream)."),
        Metric("ray_serve_replica_processing_queries", "gauge", "serve",
               "Requests a replica is processing right now."),
        Metric("ray_vllm_time_to_first_token_seconds", "histogram", "vllm",
               "Time to first token inside the engine."),
        Metric("ray_vllm_inter_token_latency_seconds", "histogram", "vllm",
               "Gap between consecutive output tokens."),
        Metric("ray_vllm_e2e_request_latency_seconds", "histogram", "vllm",
               "Engine-side end-to-end request latency."),
        Metric("ray_vllm_generation_tokens_total", "counter", "vllm", "Output tokens produced."),
        Metric("ray_vllm_prompt_tokens_total", "counter", "vllm", "Prompt tokens processed."),
        Metric("ray_vllm_num_requests_running", "gauge", "vllm",
               "Requests in the engine's running batch."),
        Metric("ray_vllm_num_requests_waiting", "gauge", "vllm",
               "Requests queued inside the engine."),
        Metric("ray_vllm_kv_cache_usage_perc", "gauge", "vllm", "KV-cache blocks in use (0..1)."),
        Metric("ray_vllm_request_time_per_output_token_seconds", "histogram", "vllm",
               "Per finished request: mean time per output token after the first (TPOT)."),
        Metric("ray_vllm_request_queue_time_seconds", "histogram", "vllm",
               "Per request: time waiting in the engine's queue before its first step."),
        Metric("ray_vllm_request_prefill_time_seconds", "histogram", "vllm",
               "Per request: time in prefill (first scheduled step to first token)."),
        Metric("ray_vllm_request_decode_time_seconds", "histogram", "vllm",
               "Per request: time in decode (first token to last)."),
        Metric("ray_vllm_request_success_total", "counter", "vllm",
               "Finished requests by finished_reason (stop, length, abort)."),
        Metric("ray_vllm_request_num_preemptions", "histogram", "vllm",
               "Preemptions per finished request (KV cache ran out while it ran)."),
        Metric("ray_vllm_request_prompt_tokens", "histogram", "vllm",
               "Prompt length of finished requests, in tokens."),
        Metric("ray_vllm_request_generation_tokens", "histogram", "vllm",
               "Output length of finished requests, in tokens."),
        Metric("ray_serve_deployment_replica_healthy", "gauge", "serve",
               "1 per replica that passes its health check, by application and deployment."),
        Metric("ray_serve_deployment_replica_starts_total", "counter", "serve",
               "Replica starts by deployment (scale-ups, redeploys and restarts after a "
               "failure)."),
        Metric("ray_serve_app_tenant_requests_total", "counter", "router",
               "Requests per tenant, model and HTTP status (429 = over quota, 401 = bad key); "
               "adapter: the LoRA adapter a request ran with on the model (\"\": the base)."),
        Metric("ray_serve_app_tenant_tokens_total", "counter", "router",
               "Prompt and completion tokens per tenant, model and LoRA adapter (\"\": the base "
               "model; kind = prompt|completion)."),
        Metric("ray_serve_app_tenant_ttft_seconds", "histogram", "router",
               "Per tenant: request arrival at the router -> first token, router queue "
               "included (what the tenant experiences)."),
        Metric("ray_serve_app_tenant_queue_wait_seconds", "histogram", "router",
               "Per tenant: time a request waited in the router's fair queue."),
        Metric("ray_serve_app_router_queued_requests", "gauge", "router",
               "Requests waiting in a router replica's fair queue, by model and priority band."),
        Metric("ray_serve_app_admission_capacity", "gauge", "router",
               "Requests of a model a router replica may have in its engines now (set from "
               "the engines' live load)."),
        Metric("ray_serve_app_model_live_replicas", "gauge", "router",
               "Live replicas of a model, as a router replica's last load poll saw them."),
        Metric("ray_serve_app_model_demand", "gauge", "router",
               "A model's demand as a router replica sees it: its queued requests plus the "
               "requests in the model's engines (what autoscaling sizes replicas for)."),
        Metric("ray_serve_app_autoscaling_target_per_replica", "gauge", "router",
               "Demand one replica of a model is sized for (autoscaling.target_per_replica)."),
        Metric("ray_serve_app_routing_decisions_total", "counter", "router",
               "Engine replica choices of the routers' requests, by model and reason: affinity "
               "(prefix_affinity: the replica its tenant and prefix hash to; prefix_cache: the "
               "replica holding its longest cached prefix or its session), load_fallback (that "
               "replica was past its load bound: routing.load_factor x the mean load and "
               "routing.imbalance_margin over the least-loaded; prefix_cache: or its load "
               "outweighed the prefill it saves), spread (prefix_cache: no replica holds any "
               "of its blocks: the least-loaded), cold "
               "(prompt under one key block: spread by power of two), power_of_two (the "
               "power_of_two policy). Counted per routing attempt: a request Serve routes "
               "again because every replica refused it counts again."),
        Metric("ray_serve_app_quota_degraded", "gauge", "router",
               "1 while a router replica enforces its local share (1/N) of every tenant "
               "limit because the app's quota actor did not answer in time (an outage), "
               "else 0."),
        Metric("ray_serve_app_adapter_swaps_total", "counter", "router",
               "LoRA adapter swaps in a model's engines, by model, adapter and event: load (the "
               "engine loaded it for a request: not held, or dropped since) and evict (dropped, "
               "least recently used, to make room in its max_cpu_loras). Loads well above the "
               "adapters in use: more adapters in use than the replicas' slots, or routing "
               "spreading an adapter (routing.adapter_replicas). Counted by the LLMServer "
               "replica.", adapters_only=True),
        Metric("ray_vllm_prefix_cache_queries_total", "counter", "vllm",
               "Prompt tokens the engine looked up in its prefix cache."),
        Metric("ray_vllm_prefix_cache_hits_total", "counter", "vllm",
               "Prompt tokens the engine found in its prefix cache (not computed again)."),
    ]
}

# The series only a model serving LoRA adapters exports.
ADAPTERS_ONLY = frozenset(m.name for m in METRICS.values() if m.adapters_only)

# Names the project registers with Ray (``ray.serve.metrics``; source "router" above: the
# router's, and adapter_swaps, the LLMServer's); Ray's exporter adds the ``ray_`` prefix and a
# counter's ``_total`` suffix, giving the table's names above.
ROUTER_METRICS = {
    "tenant_requests": "serve_app_tenant_requests",
    "tenant_tokens": "serve_app_tenant_tokens",
    "router_queued": "serve_app_router_queued_requests",
    "tenant_ttft": "serve_app_tenant_ttft_seconds",
    "tenant_queue_wait": "serve_app_tenant_queue_wait_seconds",
    "admission_capacity": "serve_app_admission_capacity",
    "live_replicas": "serve_app_model_live_replicas",
    "demand": "serve_app_model_demand",
    "target_per_replica": "serve_app_autoscaling_target_per_replica",
    "routing_decisions": "serve_app_routing_decisions",
    "quota_degraded": "serve_app_quota_degraded",
    "adapter_swaps": "serve_app_adapter_swaps",
}

# Histogram buckets (seconds) of the router's latency metrics.
LATENCY_BUCKETS_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]


def exported_name(registered: str, kind: str) -> str:
    """The name Prometheus sees for a metric registered with Ray as ``registered``."""
    return "ray_" + registered + ("_total" if kind == "counter" else "")


def metric(name: str) -> str:
    """``name`` checked against the table (a typo fails at import, not on a blank panel)."""
    if name not in METRICS:
        raise KeyError(f"{name} is not in serve_app.observability.metrics.METRICS")
    return name


def vllm_native_name(name: str) -> str:
    """The name bare vLLM's own ``/metrics`` gives a vLLM metric of the table
    (``ray_vllm_x`` -> ``vllm:x``): benchmarks read it from a bare vLLM server beside the stack."""
    metric(name)
    if not name.startswith("ray_vllm_"):
        raise ValueError(f"{name} is not a vLLM engine metric")
    return "vllm:" + name.removeprefix("ray_vllm_")
