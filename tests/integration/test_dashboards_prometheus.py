"""The Grafana dashboards against a real Prometheus (Debian's ``prometheus``) scraping the running
stack through the committed scrape config: every query of every panel must return data while
traffic flows. A renamed metric, a label that does not exist or a scrape config that finds no
target shows up here as a named panel without data, not as a blank graph in production."""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from serve_app.observability.dashboards import DASHBOARDS
from serve_app.observability.previews import (
    datasource_interval_s,
    finite_points,
    grafana_step,
    panel_queries,
    query_range,
    rate_interval,
    render_all,
)

from .prometheus import MISSING, WHY_MISSING, targets_health

pytestmark = [pytest.mark.integration, pytest.mark.skipif(MISSING, reason=WHY_MISSING)]

# Each panel's query as Grafana sends it: a range query over the last WINDOW_S with Grafana's step
# and $__rate_interval for the provisioned datasource's interval (serve_app.observability.previews).
WINDOW_S = 60.0
# With this set (`make dashboard-previews`), the test draws the dashboards' PNG previews there
# after keeping the traffic up for PREVIEW_TRAFFIC_S, so every panel has a few minutes of history.
PREVIEW_DIR = os.environ.get("DASHBOARD_PREVIEWS_DIR")
PREVIEW_TRAFFIC_S = 180.0


def _dashboard_queries(adapters_only: bool = False) -> list[tuple[str, str, str, str]]:
    """(dashboard, panel title, PromQL with Grafana's variables filled in, legend format) for
    every target (the `model` variable at "All", its allValue `.*`) that reads the suite's
    stack's series, or with ``adapters_only`` those only a model serving LoRA adapters
    exports (checked against test_lora.py's app)."""
    step = grafana_step(WINDOW_S, datasource_interval_s())
    rate = rate_interval(step, datasource_interval_s())
    return [(q.dashboard, q.panel, q.expr, q.legend)
            for name in DASHBOARDS for q in panel_queries(name, rate)
            if q.adapters_only == adapters_only]


ADAPTER_PANELS = {title for _, title, _, _ in _dashboard_queries(adapters_only=True)}


def _legend_gaps(result: list[dict[str, Any]], legend: str) -> set[str]:
    """Labels a panel's legend names that some series of its result lacks (Grafana would
    draw an empty name for them)."""
    wanted = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
    return {label for series in result for label in wanted if label not in series["metric"]}


def _query(url: str, expr: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]["result"]


def _panel_result(url: str, expr: str) -> list[dict[str, Any]]:
    """The panel's query as Grafana runs it: over the last WINDOW_S, Grafana's step."""
    end = time.time()
    return query_range(url, expr, end - WINDOW_S, end,
                       grafana_step(WINDOW_S, datasource_interval_s()))


class _Traffic:
    """Keeps every kind of request a panel draws flowing: text and chat, JSON and streamed,
    and the client errors the error panel counts (404 unknown model, 400 bad parameter)."""

    def __init__(self, stack: dict) -> None:
        self.base, self.model, self.headers = stack["base"], stack["model"], stack["headers"]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.base, timeout=60, headers=self.headers) as c:
            while not self.stop.is_set():
                c.post("/v1/completions",
                       json={"model": self.model, "prompt": "hello", "max_tokens": 4})
                with c.stream("POST", "/v1/chat/completions", json={
                        "model": self.model, "max_tokens": 4, "stream": True,
                        "messages": [{"role": "user", "content": "hi"}]}) as r:
                    for _ in r.iter_bytes():
                        pass
                c.post("/v1/completions", json={"model": "no-such-model", "prompt": "x"})
                c.post("/v1/completions",
                       json={"model": self.model, "prompt": "x", "max_tokens": -1})
                self.stop.wait(0.2)

    def __enter__(self) -> "_Traffic":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=120)


def test_scrape_config_finds_ray_metrics_agents(prometheus):
    deadline = time.time() + 60
    while time.time() < deadline:
        active = targets_health(prometheus)
        if active and all(health == "up" for _, health, _, _ in active):
            break
        time.sleep(1)
    assert active, "the committed file_sd config found no Ray metrics agent"
    assert all(health == "up" for _, health, _, _ in active), active


def test_every_dashboard_query_returns_data(stack, prometheus):
    queries = _dashboard_queries()
    assert len(queries) >= 10
    missing = queries
    gaps: dict[str, set[str]] = {}
    with _Traffic(stack):
        started = time.time()
        deadline = started + 150
        while missing and time.time() < deadline:
            still = []
            for q in missing:
                result = _panel_result(prometheus, q[2])
                if any(finite_points(series) for series in result):
                    if _legend_gaps(result, q[3]):
                        gaps[q[2]] = _legend_gaps(result, q[3])
                else:
                    still.append(q)
            missing = still
            time.sleep(2)
        if PREVIEW_DIR and not missing:
            time.sleep(max(0.0, started + PREVIEW_TRAFFIC_S - time.time()))
            drawn = render_all(prometheus, Path(PREVIEW_DIR), range_s=time.time() - started)
            empty = {d: [t for t, n in panels.items() if not n and t not in ADAPTER_PANELS]
                     for d, panels in drawn.items()}
            assert not any(empty.values()), f"preview panels drawn without data: {empty}"
    assert not missing, "panels without data:\n" + "\n".join(
        f"  {d} / {title}: {expr}" for d, title, expr, _ in missing)
    assert not gaps, f"legend labels absent from the query's series: {gaps}"


def _drawn(panels: dict[str, int]) -> bool:
    """Every panel drew a series, but those of adapter-only series (the stack has none)."""
    return all(n for t, n in panels.items() if t not in ADAPTER_PANELS)


def test_previews_draw_every_panel_from_the_live_data(stack, prometheus, tmp_path):
    """The PNG previews (`serve-app dashboards --preview`) come from the same queries: under
    traffic, every panel of every dashboard draws at least one series."""
    with _Traffic(stack):
        deadline = time.time() + 150
        while True:  # at once when earlier traffic is in Prometheus's history
            drawn = render_all(prometheus, tmp_path, range_s=300)
            if all(_drawn(p) for p in drawn.values()) or time.time() > deadline:
                break
            time.sleep(2)
    for name, panels in drawn.items():
        png = tmp_path / f"{Path(name).stem}.png"
        assert png.stat().st_size > 10_000, png
        assert _drawn(panels), {t: n for t, n in panels.items() if not n}


def test_per_status_split_matches_the_traffic(stack, prometheus):
    """The status-code split the dashboard draws holds the 200s, 400s and 404s we sent."""
    with _Traffic(stack):
        deadline = time.time() + 90
        codes: set[str] = set()
        while time.time() < deadline:
            result = _query(prometheus, "sum by (status_code) "
                            "(increase(ray_serve_num_http_requests_total[1m]))")
            codes = {s["metric"].get("status_code", "") for s in result
                     if float(s["value"][1]) > 0}
            if {"200", "400", "404"} <= codes:
                break
            time.sleep(2)
    assert {"200", "400", "404"} <= codes, codes
    assert not any(c.startswith("5") for c in codes), codes


def test_alert_rules_load_and_evaluate_against_the_live_metrics(stack, prometheus):
    """Every committed alert rule is loaded from the committed config and evaluates without
    error against the scraped series; the series each rule reads exist (a renamed metric would
    leave an alert that can never fire)."""

    from serve_app.observability.alerts import alert_rules

    expected = {r["alert"] for g in alert_rules()["groups"] for r in g["rules"]}
    with _Traffic(stack):
        deadline = time.time() + 60
        while time.time() < deadline:
            groups = httpx.get(f"{prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            if {r["name"] for r in rules} == expected and all(
                    r.get("health") == "ok" for r in rules):
                break
            time.sleep(1)
    assert {r["name"] for r in rules} == expected
    assert all(r.get("health") == "ok" for r in rules), [
        (r["name"], r.get("health"), r.get("lastError")) for r in rules]
    for rule in rules:
        for name in set(re.findall(r"\b(ray_[a-z0-9_]+?)(?:_bucket|_count)?\b", rule["query"])):
            assert _query(prometheus, f"count({name}) or count({name}_bucket)"), (
                rule["name"], name)
