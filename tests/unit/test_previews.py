"""Dashboard previews (serve_app.observability.previews): Grafana's query expansion and drawing."""

from pathlib import Path

import pytest

from serve_app.observability import previews
from serve_app.observability.dashboards import DASHBOARDS


def test_step_and_rate_interval_follow_grafana():
    # 1 h over ~600 points: 6 s steps; never below the datasource's interval.
    assert previews.grafana_step(3600, 5) == 6
    assert previews.grafana_step(60, 5) == 5
    # $__rate_interval = max(4 x interval, step + interval)
    assert previews.rate_interval(5, 5) == "20s"
    assert previews.rate_interval(60, 5) == "65s"


def test_datasource_interval_comes_from_the_provisioning_file():
    assert previews.datasource_interval_s() == 5.0


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_every_target_is_expanded(name):
    queries = previews.panel_queries(name, "20s")
    assert queries
    for q in queries:
        assert "$" not in q.expr, q  # no Grafana variable left for Prometheus to choke on
        assert q.panel


def test_legend_fills_labels_and_falls_back_to_the_label_set():
    series = {"metric": {"tenant": "team-a", "status": "200"}}
    assert previews.legend_of(series, "{{tenant}} {{ status }}") == "team-a 200"
    assert previews.legend_of(series, "") == "{status=200, tenant=team-a}"


def test_render_draws_every_panel_and_counts_empty_ones(tmp_path, monkeypatch):
    """With a stand-in Prometheus: every panel gets a series except the one whose values are all
    NaN (a quantile over no traffic), which the result reports as empty."""
    name = sorted(DASHBOARDS)[0]
    queries = previews.panel_queries(name, "20s")
    nan_expr = queries[0].expr

    def fake_query_range(url, expr, start, end, step):
        value = "NaN" if expr == nan_expr else "1.5"
        return [{"metric": {"model": "m"}, "values": [[start + i * step, value]
                                                       for i in range(10)]}]

    monkeypatch.setattr(previews, "query_range", fake_query_range)
    path, drawn = previews.render(name, "http://prometheus", tmp_path, range_s=60)
    assert path == tmp_path / f"{Path(name).stem}.png" and path.stat().st_size > 10_000
    first_panel = queries[0].panel
    only_nan = all(q.expr == nan_expr for q in queries if q.panel == first_panel)
    assert (drawn[first_panel] == 0) == only_nan
    assert all(n > 0 for title, n in drawn.items() if title != first_panel)
