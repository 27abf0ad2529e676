"""bench/prefix_affinity_report.py's pure parts: counters per replica, hit rates, balance."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "prefix_affinity_report",
    Path(__file__).resolve().parents[2] / "bench" / "prefix_affinity_report.py")
report = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(report)

PAGE = """\
# TYPE ray_vllm_prefix_cache_queries_total counter
ray_vllm_prefix_cache_queries_total{ReplicaId="r1",engine="0",model_name="m"} 1000.0
ray_vllm_prefix_cache_hits_total{ReplicaId="r1",engine="0",model_name="m"} 900.0
ray_vllm_prefix_cache_queries_total{ReplicaId="r2",engine="0",model_name="m"} 500.0
ray_vllm_prefix_cache_hits_total{ReplicaId="r2",engine="0",model_name="m"} 100.0
ray_vllm_request_success_total{ReplicaId="r2",finished_reason="length",model_name="m"} 7.0
ray_vllm_request_success_total{ReplicaId="r2",finished_reason="stop",model_name="m"} 3.0
ray_vllm_num_requests_running{ReplicaId="r2",model_name="m"} 4.0
"""


def test_counters_are_summed_per_replica():
    c = report.parse_counters(PAGE)
    assert c["r1"] == {"queries": 1000.0, "hits": 900.0, "finished": 0.0}
    assert c["r2"] == {"queries": 500.0, "hits": 100.0, "finished": 10.0}


ROUTERS_PAGE = """\
ray_serve_app_routing_decisions_total{ReplicaId="router1",model="m",reason="affinity"} 30.0
ray_serve_app_routing_decisions_total{ReplicaId="router1",model="m",reason="load_fallback"} 4.0
ray_serve_app_routing_decisions_total{ReplicaId="router2",model="m",reason="affinity"} 12.0
"""


def test_routing_decisions_are_counted_by_reason_over_the_run():
    before = report.parse_counters(ROUTERS_PAGE)
    after = report.parse_counters(ROUTERS_PAGE.replace("30.0", "50.0").replace(
        "} 4.0", "} 9.0").replace("12.0", "13.0"))
    assert before["router1"]["decision:load_fallback"] == 4.0
    assert report.decisions(before, after) == {"affinity": 21.0, "load_fallback": 5.0}
    # A router that started during the run counts from 0; engines carry no decisions.
    assert report.decisions({}, before) == {"affinity": 42.0, "load_fallback": 4.0}
    assert report.decisions({}, report.parse_counters(PAGE)) == {}


def test_hit_rates_are_over_the_run_only():
    before = {"r1": {"queries": 600.0, "hits": 500.0, "finished": 0.0}}
    rates = report.hit_rates(before, report.parse_counters(PAGE))
    assert rates["r1"]["hit_rate"] == 1.0  # 400 queried, 400 hit since `before`
    assert rates["r2"]["hit_rate"] == 0.2


def test_balance_is_the_ratio_of_mean_running_over_busy_samples():
    lines = [json.dumps({"t": 0, "models": {"m": {"a": [0, 0], "b": [0, 0]}}}),  # idle: skipped
             json.dumps({"t": 1, "models": {"m": {"a": [6, 0], "b": [4, 1]}}}),
             json.dumps({"t": 2, "models": {"m": {"a": [6, 0], "b": [4, 0]}}})]
    means, ratio = report.load_balance(lines)
    assert means == {"a": 6.0, "b": 4.0} and ratio == 1.5
    assert math.isnan(report.load_balance([])[1])


def test_the_table_pairs_the_policies_of_a_workload(tmp_path):
    for policy, ttft, tput, hits in (("power_of_two", 300.0, 1000.0, 600.0),
                                     ("prefix_affinity", 120.0, 1400.0, 950.0)):
        arm = tmp_path / f"shared--{policy}"
        arm.mkdir()
        (arm / "results.json").write_text(json.dumps({"runs": [{"summary": {
            "ttft_ms": {"median": ttft, "p99": 2 * ttft}, "output_throughput": tput,
            "failed": 0}}]}))
        (arm / "before.json").write_text("{}")
        (arm / "after.json").write_text(json.dumps(
            {"r1": {"queries": 1000.0, "hits": hits, "finished": 5.0},
             "router1": {"queries": 0.0, "hits": 0.0, "finished": 0.0,
                         "decision:affinity": 4.0, "decision:load_fallback": 1.0}}))
    text = report.table(tmp_path)
    assert "| shared | prefix_affinity | 120.0 | 240.0 | 1400 | 0.950 |" in text
    assert "| affinity 4, load_fallback 1 | 0 |" in text  # the router is no engine row
    assert "TTFT p50 **0.40x**, output throughput **1.40x**, hit rate 0.60 -> 0.95" in text
