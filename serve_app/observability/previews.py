"""Dashboard previews: each panel's PromQL run the way Grafana runs it, drawn with matplotlib.

Grafana sends a panel's query as a range query with a step derived from the time range and the
panel's width (never below the datasource's scrape interval) and replaces ``$__rate_interval``
with ``max(4 x scrape interval, step + scrape interval)``; template variables at "All" become
their ``allValue``. :func:`panel_queries` does the same expansion, so the live-Prometheus test
and the PNGs under ``dashboards/previews/`` see exactly what a Grafana panel would.

usage: ``serve-app dashboards --preview URL --out dashboards/previews`` (a Prometheus that has
scraped the running stack for a few minutes), or ``make dashboard-previews``.
"""

from __future__ import annotations

import functools
import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from serve_app.observability.dashboards import DASHBOARD_DIR, DASHBOARDS
from serve_app.observability.metrics import ADAPTERS_ONLY

# Grafana's default maximum of data points per panel is about its width in pixels.
MAX_DATA_POINTS = 600


@functools.lru_cache(maxsize=1)
def datasource_interval_s() -> float:
    """The provisioned datasource's ``timeInterval`` (Grafana's minimum step and the base of
    ``$__rate_interval``), from ``dashboards/provisioning/datasources.yaml``."""
    import yaml

    doc = yaml.safe_load((DASHBOARD_DIR / "provisioning" / "datasources.yaml").read_text())
    value = doc["datasources"][0]["jsonData"]["timeInterval"]
    match = re.fullmatch(r"(\d+)(s|m)", value)
    if not match:
        raise ValueError(f"datasources.yaml: timeInterval {value!r} is not like '5s' or '1m'")
    return float(match.group(1)) * (60 if match.group(2) == "m" else 1)


@dataclass(frozen=True)
class PanelQuery:
    """One target of one panel, with Grafana's variables filled in."""

    dashboard: str
    panel: str
    expr: str
    legend: str
    unit: str

    @property
    def adapters_only(self) -> bool:
        """Whether the query reads a series only a model serving LoRA adapters exports: it
        draws nothing on a stack without adapters, which is not a broken panel."""
        return any(name in self.expr for name in ADAPTERS_ONLY)


def grafana_step(range_s: float, scrape_interval_s: float) -> float:
    """The step Grafana picks for a panel over ``range_s`` seconds (whole seconds)."""
    return float(max(scrape_interval_s, math.ceil(range_s / MAX_DATA_POINTS)))


def rate_interval(step_s: float, scrape_interval_s: float) -> str:
    """Grafana's ``$__rate_interval`` for that step."""
    return f"{int(max(4 * scrape_interval_s, step_s + scrape_interval_s))}s"


def panel_queries(name: str, rate: str) -> list[PanelQuery]:
    """Every target of dashboard ``name``, ``$__rate_interval`` = ``rate``, variables at All."""
    dash = json.loads((DASHBOARD_DIR / name).read_text())
    all_values = {v["name"]: v.get("allValue", ".*")
                  for v in dash["templating"]["list"] if v["type"] == "query"}
    out = []
    for panel in dash["panels"]:
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", rate)
            for var, value in all_values.items():
                expr = expr.replace(f"${var}", value)
            out.append(PanelQuery(name, panel["title"], expr, target.get("legendFormat", ""),
                                  unit))
    return out


def query_range(prometheus: str, expr: str, start: float, end: float, step: float
                ) -> list[dict[str, Any]]:
    """``/api/v1/query_range`` result (series with ``metric`` and ``values``); raises on error."""
    r = httpx.get(f"{prometheus}/api/v1/query_range", timeout=30,
                  params={"query": expr, "start": start, "end": end, "step": step})
    body = r.json()
    if r.status_code != 200 or body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body}")
    return body["data"]["result"]


def legend_of(series: dict[str, Any], legend: str) -> str:
    """A series' name as Grafana draws it: ``{{label}}`` filled in, else its label set."""
    labels = series.get("metric", {})
    if legend:
        return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: str(labels.get(m.group(1), "")), legend)
    return "{" + ", ".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"


def finite_points(series: dict[str, Any]) -> list[tuple[float, float]]:
    """The series' (time, value) points that have a finite value (quantiles of nothing are NaN)."""
    points = [(float(t), float(v)) for t, v in series.get("values", [])]
    return [(t, v) for t, v in points if math.isfinite(v)]


def render(name: str, prometheus: str, out_dir: Path, range_s: float = 300.0,
           scrape_interval_s: float | None = None, end: float | None = None
           ) -> tuple[Path, dict[str, int]]:
    """Draw dashboard ``name`` over the last ``range_s`` seconds into ``out_dir/<name>.png``;
    returns the file and, per panel title, how many series it drew."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = time.time() if end is None else end
    start = end - range_s
    if scrape_interval_s is None:
        scrape_interval_s = datasource_interval_s()
    step = grafana_step(range_s, scrape_interval_s)
    queries = panel_queries(name, rate_interval(step, scrape_interval_s))
    panels: dict[str, list[PanelQuery]] = {}
    for q in queries:
        panels.setdefault(q.panel, []).append(q)
    cols = 2
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(14, 2.7 * rows), squeeze=False)
    drawn: dict[str, int] = {}
    for ax, (title, targets) in zip(axes.flat, panels.items()):
        count, labelled = 0, False
        for q in targets:
            for series in query_range(prometheus, q.expr, start, end, step):
                points = finite_points(series)
                if not points:
                    continue
                scale = 100.0 if q.unit == "percentunit" else 1.0
                label = legend_of(series, q.legend)[:40]
                ax.plot([t - end for t, _ in points], [v * scale for _, v in points],
                        linewidth=1.2, label=label or None)
                count += 1
                labelled = labelled or bool(label)
        drawn[title] = count
        unit = targets[0].unit
        ax.set_title(title, fontsize=10, loc="left")
        ax.set_ylabel({"percentunit": "%", "short": ""}.get(unit, unit), fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if labelled:
            ax.legend(fontsize=6, loc="upper left", ncol=2)
        elif not count:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("seconds before the snapshot", fontsize=8)
    dash_title = json.loads((DASHBOARD_DIR / name).read_text()).get("title", name)
    fig.suptitle(f"{dash_title} (preview: the dashboard's PromQL against a live Prometheus)",
                 fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.99))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{Path(name).stem}.png"
    fig.savefig(path, dpi=60)
    plt.close(fig)
    return path, drawn


def render_all(prometheus: str, out_dir: Path, range_s: float = 300.0
               ) -> dict[str, dict[str, int]]:
    """:func:`render` for every dashboard; returns the series drawn per panel per dashboard."""
    return {name: render(name, prometheus, out_dir, range_s)[1] for name in DASHBOARDS}
