"""Prometheus alert rules for the on-call engineer, built from the metric table like the
dashboards (``serve-app dashboards`` writes ``dashboards/alerts.yml``; a unit test keeps the
committed file equal to this builder, ``promtool check rules`` validates it and ``promtool test
rules`` runs ``dashboards/alerts_test.yml`` against it).

Each rule says what is wrong for users (not which process misbehaves) and what to look at.
"""

from __future__ import annotations

from typing import Any

import yaml

from serve_app.observability.metrics import metric

# TTFT objective of the burn-rate alert: this share of requests gets a first token within
# TTFT_SLO_S (a bucket boundary of the router's TTFT histogram).
TTFT_SLO_S = "2.5"
TTFT_SLO_TARGET = 0.99
ERROR_RATIO_PAGE = 0.05


def _rule(name: str, expr: str, for_: str, severity: str, summary: str,
          description: str) -> dict[str, Any]:
    return {"alert": name, "expr": expr, "for": for_, "labels": {"severity": severity},
            "annotations": {"summary": summary, "description": description}}


def alert_rules() -> dict[str, Any]:
    """The rule groups, as Prometheus' rule-file YAML structure."""
    requests = metric("ray_serve_app_tenant_requests_total")
    ttft = metric("ray_serve_app_tenant_ttft_seconds")
    queued = metric("ray_serve_app_router_queued_requests")
    replicas = metric("ray_serve_app_model_live_replicas")
    kv = metric("ray_vllm_kv_cache_usage_perc")
    quota_degraded = metric("ray_serve_app_quota_degraded")
    budget = round(1 - TTFT_SLO_TARGET, 6)

    def slow_share(window: str) -> str:
        return (f'(1 - sum by (model) (rate({ttft}_bucket{{le="{TTFT_SLO_S}"}}[{window}])) / '
                f"sum by (model) (rate({ttft}_count[{window}])))")

    rules = [
        _rule("ServeAppHighErrorRatio",
              f'sum by (model) (rate({requests}{{status=~"5.."}}[5m])) / '
              f"sum by (model) (rate({requests}[5m])) > {ERROR_RATIO_PAGE}",
              "5m", "page",
              "{{ $labels.model }}: over 5% of requests fail with a server error",
              "5xx answers are the service's fault (clients get 4xx for their own mistakes). "
              "Look at the router's and the model replicas' logs and at engine restarts."),
        _rule("ServeAppTTFTBudgetBurn",
              f"{slow_share('5m')} > {14.4 * budget:g} and {slow_share('1h')} > "
              f"{14.4 * budget:g}",
              "2m", "page",
              "{{ $labels.model }}: first tokens slower than " + TTFT_SLO_S + " s burn the "
              "TTFT budget 14x too fast",
              f"The objective is {TTFT_SLO_TARGET:.0%} of requests with a first token within "
              f"{TTFT_SLO_S} s (router queue included). At this rate a 30-day budget lasts "
              "two days. Check the queue and replica panels: add replicas (autoscaling "
              "max_replicas) or tighten tenant quotas."),
        _rule("ServeAppQueueGrowing",
              f"sum by (model) ({queued}) > 0 and "
              f"deriv(sum by (model) ({queued})[10m:1m]) >= 0",
              "10m", "ticket",
              "{{ $labels.model }}: requests have waited in the router for 10 minutes and the "
              "backlog is not shrinking",
              "Demand exceeds what the live replicas run. Autoscaling at max_replicas, or "
              "replicas that cannot be placed (GPUs busy): see the replicas panel and "
              "`ray status`."),
        _rule("ServeAppNoReplicaWhileQueued",
              f"max by (model) ({replicas}) == 0 and sum by (model) ({queued}) > 0",
              "5m", "page",
              "{{ $labels.model }}: requests wait and no replica of the model is running",
              "A cold start that does not finish (no free GPU, a model path that fails to "
              "load) or a replica that crashes on start. Queued requests get 503 after "
              "router.admission.cold_start_timeout_s. See the Serve controller's log."),
        _rule("ServeAppReplicasFlapping",
              f"changes(max by (model) ({replicas})[30m:1m]) > 6",
              "0m", "ticket",
              "{{ $labels.model }}: the replica count changed more than 6 times in 30 minutes",
              "Autoscaling oscillates (raise autoscaling.downscale_delay_s or lower "
              "downscale_utilization) or replicas keep dying and restarting (engine logs)."),
        _rule("ServeAppKVCacheNearlyFull",
              f"max by (model_name) ({kv}) > 0.95",
              "10m", "ticket",
              "{{ $labels.model_name }}: an engine's KV cache has been over 95% full for 10 "
              "minutes",
              "The engine preempts requests to make room (latency spikes). Lower "
              "max_num_seqs, raise gpu_memory_utilization, or add replicas."),
        _rule("ServeAppQuotaDegraded",
              f"max by (application) ({quota_degraded}) > 0",
              "1m", "ticket",
              "{{ $labels.application }}: router replicas enforce local quota shares: the "
              "app's quota actor does not answer",
              "Each router replica in an outage admits every tenant from its own 1/N share of "
              "the limits (serve_app/governance/cluster_quota.py): a tenant whose requests are "
              "spread unevenly is refused early or, on replicas that had not served it, can "
              "pass its limit. Find the `<app>-quota` actor in `ray list actors` (namespace "
              "serve_app): dead, restarting, or its node overloaded. Routers probe it every "
              "5 s and resume leases on its first answer."),
        _rule("ServeAppScrapeTargetDown",
              'up{job="ray"} == 0',
              "2m", "page",
              "Prometheus cannot scrape {{ $labels.instance }}",
              "A Ray node's metrics agent is unreachable: the node is down or its agent "
              "crashed. Every panel fed by it is blank."),
    ]
    return {"groups": [{"name": "serve-app", "rules": rules}]}


def render_alerts() -> str:
    """The committed text of ``dashboards/alerts.yml``."""
    header = ("# Generated by `serve-app dashboards` from serve_app/observability/alerts.py; "
              "do not edit.\n# Load it with `rule_files:` (dashboards/prometheus.yml does).\n")
    return header + yaml.safe_dump(alert_rules(), sort_keys=False, width=100)
