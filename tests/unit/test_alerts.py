"""Alert rules: the committed file is the builder's output, promtool accepts it, and promtool's
rule unit tests show each alert firing on the failure it names and staying quiet otherwise."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from serve_app.observability.alerts import alert_rules, render_alerts
from serve_app.observability.dashboards import DASHBOARD_DIR


def _promtool() -> str:
    prometheus = os.environ.get("PROMETHEUS_BIN")
    candidate = Path(prometheus).with_name("promtool") if prometheus else None
    found = str(candidate) if candidate and candidate.exists() else shutil.which("promtool")
    if not found:
        pytest.skip("promtool not found: `make prometheus` unpacks it (make test does)")
    return found


def test_committed_alerts_match_builder():
    committed = (DASHBOARD_DIR / "alerts.yml").read_text()
    assert committed == render_alerts(), "run `serve-app dashboards` to refresh alerts.yml"


def test_promtool_checks_the_committed_rules_and_config():
    for args in (["check", "rules", str(DASHBOARD_DIR / "alerts.yml")],
                 ["check", "config", str(DASHBOARD_DIR / "prometheus.yml")]):
        done = subprocess.run([_promtool(), *args], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


RULES = {r["alert"]: r for g in alert_rules()["groups"] for r in g["rules"]}


def _expected(alert: str, labels: dict[str, str]) -> dict:
    rule = RULES[alert]

    def expand(text: str) -> str:
        return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m.group(1), ""), text)

    return {"exp_labels": {**labels, **rule["labels"]},
            "exp_annotations": {k: expand(v) for k, v in rule["annotations"].items()}}


# (alert, input series {series: values}, eval time, labels of the expected alerts: [] = quiet)
CASES = [
    ("ServeAppHighErrorRatio", {
        'ray_serve_app_tenant_requests_total{model="m",tenant="a",status="200"}': "0+60x30",
        'ray_serve_app_tenant_requests_total{model="m",tenant="a",status="503"}': "0+10x30",
        'ray_serve_app_tenant_requests_total{model="ok",tenant="a",status="200"}': "0+60x30",
        'ray_serve_app_tenant_requests_total{model="ok",tenant="a",status="429"}': "0+60x30",
    }, "20m", [{"model": "m"}]),
    ("ServeAppTTFTBudgetBurn", {
        'ray_serve_app_tenant_ttft_seconds_bucket{model="slow",tenant="a",le="2.5"}': "0+50x120",
        'ray_serve_app_tenant_ttft_seconds_count{model="slow",tenant="a"}': "0+100x120",
        'ray_serve_app_tenant_ttft_seconds_bucket{model="fast",tenant="a",le="2.5"}': "0+99x120",
        'ray_serve_app_tenant_ttft_seconds_count{model="fast",tenant="a"}': "0+100x120",
    }, "90m", [{"model": "slow"}]),
    ("ServeAppQueueGrowing", {
        'ray_serve_app_router_queued_requests{model="grow",band="normal"}': "0+1x40",
        'ray_serve_app_router_queued_requests{model="drain",band="normal"}': "80-2x40",
    }, "30m", [{"model": "grow"}]),
    ("ServeAppNoReplicaWhileQueued", {
        'ray_serve_app_model_live_replicas{model="cold"}': "0x20",
        'ray_serve_app_router_queued_requests{model="cold",band="normal"}': "5x20",
        'ray_serve_app_model_live_replicas{model="idle"}': "0x20",
        'ray_serve_app_router_queued_requests{model="idle",band="normal"}': "0x20",
    }, "10m", [{"model": "cold"}]),
    ("ServeAppReplicasFlapping", {
        'ray_serve_app_model_live_replicas{model="flap"}': "1 2 " * 15,
        'ray_serve_app_model_live_replicas{model="steady"}': "1x10 2x20",
    }, "29m", [{"model": "flap"}]),
    ("ServeAppKVCacheNearlyFull", {
        'ray_vllm_kv_cache_usage_perc{model_name="full",engine="0"}': "0.97x20",
        'ray_vllm_kv_cache_usage_perc{model_name="busy",engine="0"}': "0.90x20",
    }, "15m", [{"model_name": "full"}]),
    ("ServeAppQuotaDegraded", {
        'ray_serve_app_quota_degraded{application="llm",replica="r1"}': "0x2 1x10",
        'ray_serve_app_quota_degraded{application="llm",replica="r2"}': "0x12",
        'ray_serve_app_quota_degraded{application="ok",replica="r1"}': "0x12",
    }, "8m", [{"application": "llm"}]),
    ("ServeAppScrapeTargetDown", {
        'up{job="ray",instance="10.0.0.1:8080"}': "0x10",
        'up{job="ray",instance="10.0.0.2:8080"}': "1x10",
    }, "5m", [{"job": "ray", "instance": "10.0.0.1:8080"}]),
]


def test_every_alert_has_a_case():
    assert {c[0] for c in CASES} == set(RULES)


def test_promtool_rule_unit_tests(tmp_path):
    shutil.copy(DASHBOARD_DIR / "alerts.yml", tmp_path / "alerts.yml")
    tests = []
    for alert, series, at, firing in CASES:
        tests.append({
            "interval": "1m",
            "input_series": [{"series": s, "values": v.strip()} for s, v in series.items()],
            "alert_rule_test": [
                {"eval_time": at, "alertname": alert,
                 "exp_alerts": [_expected(alert, labels) for labels in firing]},
                # Before its `for` time has passed (and before any data), nothing fires.
                {"eval_time": "0m", "alertname": alert, "exp_alerts": []},
            ],
        })
    spec = {"rule_files": ["alerts.yml"], "evaluation_interval": "1m", "tests": tests}
    (tmp_path / "alerts_test.yml").write_text(yaml.safe_dump(spec, sort_keys=False))
    done = subprocess.run([_promtool(), "test", "rules", "alerts_test.yml"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
