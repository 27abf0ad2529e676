"""Dashboards are generated from the metric table, and the committed JSON is up to date."""

import json
import re

from serve_app.observability.dashboards import DASHBOARD_DIR, DASHBOARDS, render
from serve_app.observability.metrics import METRICS


def test_committed_dashboards_match_builder():
    for name in DASHBOARDS:
        committed = (DASHBOARD_DIR / name).read_text()
        assert committed == render(name), f"run `serve-app dashboards` to refresh {name}"


def test_every_query_uses_known_metrics():
    for name in DASHBOARDS:
        dash = json.loads(render(name))
        assert dash["panels"]
        for panel in dash["panels"]:
            for target in panel["targets"]:
                used = set(re.findall(r"\b(ray_[a-z0-9_]+?)(?:_bucket|_sum|_count)?\b",
                                      target["expr"]))
                assert used, target["expr"]
                assert used <= set(METRICS), used - set(METRICS)


def test_serving_dashboard_covers_the_serving_path():
    titles = " ".join(p["title"].lower() for p in json.loads(render("serving.json"))["panels"])
    for word in ("requests", "errors", "first token", "tokens per second", "running"):
        assert word in titles
