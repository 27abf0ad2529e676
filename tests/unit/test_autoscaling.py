"""Queue-depth autoscaling policy (serve_app/autoscaling.py): bounds, hysteresis, from zero,
noisy signal; driven through a stand-in for Serve's AutoscalingContext."""

from __future__ import annotations

from types import SimpleNamespace

from serve_app.autoscaling import QueueDepthPolicy, decide, demand_of
from serve_app.app import llm_server_options
from serve_app.config import ModelSettings


def ctx(current, in_engine=(), router_queued=(), handle_queued=0.0, total=None, lo=1, hi=4,
        state=None):
    replicas = [f"r{i}" for i in range(len(in_engine))]
    return SimpleNamespace(
        current_num_replicas=current, deployment_name="LLMServer-m",
        aggregated_metrics={"in_engine": dict(zip(replicas, in_engine)),
                            "router_queued": dict(zip(replicas, router_queued))},
        total_queued_requests=handle_queued,
        total_num_requests=total if total is not None else sum(in_engine) + handle_queued,
        capacity_adjusted_min_replicas=lo, capacity_adjusted_max_replicas=hi,
        policy_state=state or {})


def test_scales_up_to_what_the_demand_needs_within_bounds():
    assert decide(300, 1, 100, 1, 4, 0.7).desired == 3
    assert decide(10_000, 1, 100, 1, 4, 0.7).desired == 4
    assert decide(0, 1, 100, 1, 4, 0.7).desired == 1


def test_scales_down_one_at_a_time_and_only_with_room_to_spare():
    assert decide(0, 3, 100, 1, 4, 0.7).desired == 2
    # 150 fits in 2 x 100 but not in 2 x 100 x 0.7: stay (hysteresis)
    assert decide(150, 3, 100, 1, 4, 0.7).desired == 3
    assert decide(140, 3, 100, 1, 4, 0.7).desired == 2


def test_noisy_demand_around_the_target_does_not_flap():
    desired, current = [], 2
    for demand in [190, 160, 205, 150, 199, 170, 185]:  # hovering near 2 x 100
        d = decide(demand, current, 100, 1, 4, 0.7).desired
        desired.append(d)
        current = d
    assert desired.count(2) + desired.count(3) == len(desired) and 1 not in desired


def test_from_zero_and_back_to_zero():
    assert decide(1, 0, 100, 0, 2, 0.7).desired == 1
    assert decide(0, 1, 100, 0, 2, 0.7).desired == 0
    # The one request waiting at Serve's handle for a cold model counts as demand.
    assert demand_of(ctx(0, handle_queued=1)) == 1


def test_demand_adds_router_backlog_once_and_engine_load_per_replica():
    c = ctx(2, in_engine=(100, 80), router_queued=(50, 50))
    assert demand_of(c) == 230
    policy = QueueDepthPolicy(target_per_replica=100, downscale_utilization=0.7, model="m")
    desired, state = policy(c)
    assert desired == 3 and state["demand"] == 230 and state["last_desired"] == 3


def test_deployment_uses_the_policy_with_fast_timings():
    m = ModelSettings(name="m", path="/m", engine_kwargs={"max_num_seqs": 128},
                      autoscaling={"min_replicas": 0, "max_replicas": 2})
    a = llm_server_options(m)["autoscaling_config"]
    assert a["policy"]["policy_function"] == "serve_app.autoscaling:QueueDepthPolicy"
    assert a["policy"]["policy_kwargs"]["target_per_replica"] == 128
    assert a["metrics_interval_s"] <= 1 and a["upscale_delay_s"] + a["look_back_period_s"] <= 5
    assert a["min_replicas"] == 0 and a["downscale_to_zero_delay_s"] == 60
