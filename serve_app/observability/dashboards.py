"""Grafana dashboards built from the metric table; ``serve-app dashboards`` writes them to
``dashboards/``. The committed JSON is checked against this builder by a unit test."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from serve_app.observability.alerts import TTFT_SLO_S, TTFT_SLO_TARGET
from serve_app.observability.metrics import METRICS, metric

DASHBOARD_DIR = Path(__file__).resolve().parents[2] / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def _panel(pid: int, title: str, exprs: list[tuple[str, str]], unit: str, x: int, y: int,
           description: str) -> dict[str, Any]:
    return {
        "id": pid,
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend,
             "datasource": DATASOURCE}
            for i, (expr, legend) in enumerate(exprs)
        ],
    }


# The model a series belongs to: vLLM labels it `model_name`, the router `model`.
MODEL_LABEL = {"vllm": "model_name", "router": "model"}
TTFT = "ray_serve_app_tenant_ttft_seconds"
SLO_BUCKET = f'le="{TTFT_SLO_S}"'


def _base_as_adapter(expr: str) -> str:
    """``expr`` with the base model's series (no ``adapter`` label: the router records "",
    which Prometheus drops) named ``(base)``, so every series has the legend's label."""
    return f'label_replace({expr}, "adapter", "(base)", "adapter", "")'


def _sel(name: str, suffix: str = "", match: str = "") -> str:
    """Series ``name`` + ``suffix`` (``_bucket``, ``_sum``, ``_count``) restricted to the
    dashboard's `model` variable where the metric has a model, plus the ``match`` matchers."""
    label = MODEL_LABEL.get(METRICS[metric(name)].source)
    matchers = [m for m in (f'{label}=~"$model"' if label else "", match) if m]
    return f"{name}{suffix}" + (f"{{{','.join(matchers)}}}" if matchers else "")


def _bucket(name: str) -> str:
    """The ``_bucket`` series of histogram ``name``, restricted like :func:`_sel`."""
    return _sel(name, "_bucket")


def _quantiles(name: str, by: str = "") -> list[tuple[str, str]]:
    """p50/p90/p99 of histogram ``name``, one line per model (and per ``by``): quantiles over
    several models mixed would describe none of them."""
    model = MODEL_LABEL.get(METRICS[metric(name)].source)
    keys = [k for k in (model, by) if k]
    group = ", ".join(["le", *keys])
    legend = " ".join(f"{{{{{k}}}}}" for k in keys)
    bucket = _bucket(name)
    return [(f"histogram_quantile({q}, sum by ({group}) (rate({bucket}[$__rate_interval])))",
             f"p{int(q * 100)}" + (f" {legend}" if legend else ""))
            for q in (0.5, 0.9, 0.99)]


def serving_dashboard() -> dict[str, Any]:
    """The serving path: requests, errors, TTFT, tokens/s, engine running/waiting, tenants."""
    rate = "[$__rate_interval]"
    hits_rate = f"rate({_sel('ray_vllm_prefix_cache_hits_total')}{rate})"
    # Requests refused before a model was read (401) have no model: not in the adapter panel.
    by_adapter = _sel("ray_serve_app_tenant_requests_total", match='model!=""')
    queries_rate = f"rate({_sel('ray_vllm_prefix_cache_queries_total')}{rate})"
    panels = [
        _panel(1, "Requests per second by status code",
               [(f"sum by (status_code) (rate({_sel('ray_serve_num_http_requests_total')}"
                 f"{rate}))", "{{status_code}}")], "reqps", 0, 0,
               "HTTP requests answered by the ingress (the router replica under Serve's direct "
               "ingress; the Serve proxy otherwise). Every route shares the app prefix \"/\", "
               "so status code is the useful split."),
        _panel(2, "Errors per second by status code",
               [(f"sum by (error_code) (rate({_sel('ray_serve_num_http_error_requests_total')}"
                 f"{rate}))", "{{error_code}}")], "reqps", 12, 0,
               "4xx are client mistakes (bad input, unknown model); 5xx are ours."),
        _panel(3, "Time to first token", _quantiles("ray_vllm_time_to_first_token_seconds"),
               "s", 0, 8, "Engine-side TTFT quantiles over all replicas."),
        _panel(4, "Tokens per second",
               [(f"sum by (model_name) (rate({_sel('ray_vllm_generation_tokens_total')}"
                 f"{rate}))", "output {{model_name}}"),
                (f"sum by (model_name) (rate({_sel('ray_vllm_prompt_tokens_total')}{rate}))",
                 "prompt {{model_name}}")],
               "short", 12, 8, "Output and prompt tokens processed by all engines."),
        _panel(5, "Engine requests running / waiting",
               [(f"sum by (model_name) ({_sel('ray_vllm_num_requests_running')})",
                 "running {{model_name}}"),
                (f"sum by (model_name) ({_sel('ray_vllm_num_requests_waiting')})",
                 "waiting {{model_name}}")], "short", 0, 16,
               "Waiting above zero means the engines are saturated."),
        _panel(6, "Inter-token latency", _quantiles("ray_vllm_inter_token_latency_seconds"),
               "s", 12, 16, "Gap between consecutive tokens (TPOT)."),
        _panel(7, "KV cache usage",
               [(f"max by (model_name) ({_sel('ray_vllm_kv_cache_usage_perc')})",
                 "{{model_name}}")], "percentunit", 0, 24,
               "Fraction of KV-cache blocks in use; near 1 means preemptions."),
        _panel(8, "HTTP latency (ingress)", _quantiles("ray_serve_http_request_latency_ms"),
               "ms", 12, 24, "Latency of whole HTTP requests at the ingress, to the last byte "
               "of a stream."),
        _panel(9, "Engine end-to-end request latency",
               _quantiles("ray_vllm_e2e_request_latency_seconds"), "s", 0, 32,
               "From arrival at the engine to its last token; the gap to the HTTP latency is "
               "the time spent in the router and on the wire."),
        _panel(10, "Requests in flight per replica",
               [(f"sum by (deployment) ({_sel('ray_serve_replica_processing_queries')})",
                 "{{deployment}}")], "short", 12, 32,
               "Requests each Serve deployment's replicas are processing now (router and "
               "LLMServer), the figure Serve routes and autoscales on."),
        _panel(11, "Requests per second by tenant and status",
               [(f"sum by (tenant, status) (rate({_sel('ray_serve_app_tenant_requests_total')}"
                 f"{rate}))", "{{tenant}} {{status}}")], "reqps", 0, 40,
               "Per tenant: 200 served, 429 over quota (requests or tokens per minute), "
               "401 bad or missing key (tenant `unauthenticated`), 499 client went away."),
        _panel(12, "Tokens per second by tenant",
               [(f"sum by (tenant, kind) (rate({_sel('ray_serve_app_tenant_tokens_total')}"
                 f"{rate}))", "{{tenant}} {{kind}}")], "short", 12, 40,
               "Prompt and completion tokens each tenant consumed: what its token quota "
               "counts."),
        _panel(13, "Requests queued in the router by priority",
               [(f"sum by (model, priority) "
                 f"({_sel('ray_serve_app_router_queued_requests')})",
                 "{{model}} {{priority}}")], "short", 0, 48,
               "Requests held in the router's fair queue because the model's engines start "
               "nothing more right now (their waiting queues are at the admission headroom); "
               "with the engines' own requests, the demand autoscaling follows."),
        _panel(14, "Time to first token by tenant (p90)",
               [(f"histogram_quantile(0.9, sum by (le, tenant) "
                 f"(rate({_bucket('ray_serve_app_tenant_ttft_seconds')}{rate})))",
                 "{{tenant}}")], "s", 12, 48,
               "From arrival at the router to the first token, router queue included: the "
               "latency each tenant sees. One tenant's flood should not raise the others'."),
        _panel(15, "Router queue wait by tenant (p90)",
               [(f"histogram_quantile(0.9, sum by (le, tenant) "
                 f"(rate({_bucket('ray_serve_app_tenant_queue_wait_seconds')}{rate})))",
                 "{{tenant}}")], "s", 0, 56,
               "Time requests waited for an engine slot in the router's fair queue."),
        _panel(16, "Autoscaling: demand, capacity and replicas",
               [(f"sum by (model) ({_sel('ray_serve_app_model_demand')})",
                 "demand {{model}}"),
                (f"sum by (model) ({_sel('ray_serve_app_admission_capacity')})",
                 "admission capacity {{model}}"),
                (f"max by (model) ({_sel('ray_serve_app_model_live_replicas')}) * "
                 f"max by (model) ({_sel('ray_serve_app_autoscaling_target_per_replica')})",
                 "replicas x target {{model}}")], "short", 12, 56,
               "Demand (queued in the routers + in the engines) against what the live replicas "
               "are sized for. Demand above the replicas x target line for longer than the "
               "upscale delay adds replicas; far below it for the downscale delay removes one."),
        _panel(17, "Live replicas per model",
               [(f"max by (model) ({_sel('ray_serve_app_model_live_replicas')})",
                 "{{model}}")], "short", 0, 64,
               "Replicas that answered the routers' last load poll (replicas that are starting "
               "or draining are not counted)."),
        _panel(18, "Time per output token (per request)",
               _quantiles("ray_vllm_request_time_per_output_token_seconds"), "s", 12, 64,
               "TPOT of finished requests: their decode time over their output tokens after "
               "the first."),
        _panel(19, "Engine time split (p90): queue, prefill, decode",
               [(f"histogram_quantile(0.9, sum by (le, model_name) (rate({_bucket(name)}"
                 f"{rate})))", f"{label} {{{{model_name}}}}")
                for name, label in (("ray_vllm_request_queue_time_seconds", "queue"),
                                    ("ray_vllm_request_prefill_time_seconds", "prefill"),
                                    ("ray_vllm_request_decode_time_seconds", "decode"))],
               "s", 0, 72,
               "Where a request's engine time goes. Queue time above a step or two means the "
               "router sends more than the engine starts (see the admission panels)."),
        _panel(20, "Finished requests by reason",
               [(f"sum by (model_name, finished_reason) "
                 f"(rate({_sel('ray_vllm_request_success_total')}{rate}))",
                 "{{model_name}} {{finished_reason}}")], "reqps", 12, 72,
               "stop: the model ended it; length: max_tokens or the context; abort: the client "
               "went away (its engine work was stopped)."),
        _panel(21, "Preemptions per second",
               [(f"sum by (model_name) "
                 f"(rate({_sel('ray_vllm_request_num_preemptions', '_sum')}{rate}))",
                 "{{model_name}}")], "short", 0, 80,
               "Requests evicted from the batch because the KV cache ran out; each one is "
               "recomputed. Above zero for long: fewer max_num_seqs or more replicas."),
        _panel(22, "Prompt and output length (p50 / p90)",
               [(f"histogram_quantile({q}, sum by (le, model_name) (rate({_bucket(name)}"
                 f"{rate})))", f"{label} p{int(q * 100)} {{{{model_name}}}}")
                for name, label in (("ray_vllm_request_prompt_tokens", "prompt"),
                                    ("ray_vllm_request_generation_tokens", "output"))
                for q in (0.5, 0.9)],
               "short", 12, 80, "Token lengths of finished requests: the workload's shape."),
        _panel(23, "Healthy replicas and starts by deployment",
               [(f"sum by (application, deployment) "
                 f"({metric('ray_serve_deployment_replica_healthy')})",
                 "healthy {{application}}/{{deployment}}"),
                (f"sum by (application, deployment) (increase("
                 f"{metric('ray_serve_deployment_replica_starts_total')}[1h]))",
                 "starts in 1 h {{application}}/{{deployment}}")], "short", 0, 88,
               "Replicas passing their health checks, and replica starts over the last hour "
               "(scale-ups and redeploys; starts without a scale-up are restarts)."),
        _panel(24, f"TTFT objective: share within {TTFT_SLO_S} s",
               [(f"sum by (model) (rate({_sel(TTFT, '_bucket', SLO_BUCKET)}"
                 f"{rate})) / sum by (model) (rate({_sel(TTFT, '_count')}{rate}))",
                 "{{model}}")], "percentunit", 12, 88,
               f"Streamed requests whose first token came within {TTFT_SLO_S} s of arrival at "
               f"the router (the alert's objective is {TTFT_SLO_TARGET:.0%})."),
        _panel(25, "Routing decisions by reason",
               [(f"sum by (model, reason) (rate({_sel('ray_serve_app_routing_decisions_total')}"
                 f"{rate}))", "{{model}} {{reason}}")], "reqps", 0, 96,
               "Where the routers sent requests, by why (routing.policy of the model): "
               "affinity = the replica the tenant's prefix hashes to; load_fallback = that "
               "replica was past its load bound (routing.load_factor x the mean and "
               "routing.imbalance_margin over the least-loaded); cold = prompt under one key "
               "block; power_of_two = a model with routing.policy power_of_two. Many "
               "load_fallback: a hot tenant, or a bound too tight to keep prefixes together."),
        _panel(26, "Prefix-cache hit rate per replica",
               [(f"(sum by (model_name, ReplicaId) ({hits_rate}) or "
                 f"sum by (model_name, ReplicaId) ({queries_rate}) * 0) / "
                 f"sum by (model_name, ReplicaId) ({queries_rate})",
                 "{{model_name}} {{ReplicaId}}")], "percentunit", 12, 96,
               "Share of prompt tokens each engine replica found in its prefix cache (vLLM's "
               "prefix-cache hits over queries, in tokens; 0 until a replica's first hit, "
               "before which vLLM exports no hit counter). prefix_affinity should raise it "
               "on workloads whose tenants share long prefixes."),
        _panel(27, "Load spread between replicas",
               [(f"max by (model_name) ({_sel('ray_vllm_num_requests_running')} + "
                 f"{_sel('ray_vllm_num_requests_waiting')}) - min by (model_name) "
                 f"({_sel('ray_vllm_num_requests_running')} + "
                 f"{_sel('ray_vllm_num_requests_waiting')})", "{{model_name}}")],
               "short", 0, 104,
               "Requests (running + waiting) in the busiest engine replica minus the least "
               "busy, per model. Affinity routing is bounded by routing.load_factor and "
               "routing.imbalance_margin; a spread well above them for long means one hot "
               "prefix pins a replica."),
        _panel(28, "Requests finished per replica",
               [(f"sum by (model_name, ReplicaId) "
                 f"(rate({_sel('ray_vllm_request_success_total')}{rate}))",
                 "{{model_name}} {{ReplicaId}}")], "reqps", 12, 104,
               "How evenly the routers spread the requests over a model's engine replicas."),
        _panel(29, "Requests per second by LoRA adapter and tenant",
               [(_base_as_adapter(f"sum by (model, adapter, tenant) (rate({by_adapter}"
                                  f"{rate}))"), "{{model}}/{{adapter}} {{tenant}}")],
               "reqps", 0, 112,
               "Each adapter's requests by the tenant that sent them (models.*.adapters: "
               "its owners, or every tenant for a public one); (base) is the model alone."),
        _panel(30, "Tokens per second by LoRA adapter",
               [(_base_as_adapter(f"sum by (model, adapter, kind) "
                                  f"(rate({_sel('ray_serve_app_tenant_tokens_total')}"
                                  f"{rate}))"), "{{model}}/{{adapter}} {{kind}}")],
               "short", 12, 112,
               "Prompt and completion tokens per adapter: the share of the base model's "
               "engines each fine-tune takes."),
        _panel(31, "LoRA adapter loads and evictions per second",
               [(f"sum by (model, adapter, event) "
                 f"(rate({_sel('ray_serve_app_adapter_swaps_total')}{rate}))",
                 "{{model}}/{{adapter}} {{event}}")],
               "ops", 0, 120,
               "The engines' adapter swaps: load (an adapter read into a replica's LoRA slots "
               "for a request) and evict (the least recently used dropped to make room). "
               "Loads that keep pace with requests in panel 29 mean thrashing: more adapters "
               "in use than max_loras x replicas, or routing.adapter_replicas spreading an "
               "adapter too thin."),
    ]
    return {
        "uid": "serve-app-serving",
        "title": "serve-app: serving path",
        "tags": ["serve-app", "vllm", "ray-serve"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus",
             "label": "Prometheus"},
            {"name": "model", "type": "query", "label": "Model", "datasource": DATASOURCE,
             "query": {"query": "label_values(ray_vllm_num_requests_running, model_name)",
                       "refId": "model"},
             "definition": "label_values(ray_vllm_num_requests_running, model_name)",
             "refresh": 2, "multi": True, "includeAll": True, "allValue": ".*",
             "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
             "sort": 1},
        ]},
        "panels": panels,
    }


DASHBOARDS = {"serving.json": serving_dashboard}


def render(name: str) -> str:
    """The committed text of dashboard ``name``."""
    return json.dumps(DASHBOARDS[name](), indent=2, sort_keys=True) + "\n"


def write_dashboards(folder: Path = DASHBOARD_DIR) -> list[Path]:
    """Write every dashboard and the alert rules (``alerts.yml``) into ``folder``."""
    from serve_app.observability.alerts import render_alerts

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in DASHBOARDS:
        (folder / name).write_text(render(name))
        paths.append(folder / name)
    (folder / "alerts.yml").write_text(render_alerts())
    paths.append(folder / "alerts.yml")
    return paths
