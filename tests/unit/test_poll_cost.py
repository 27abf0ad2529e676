"""The poll-cost bench's pure parts: its record files, the window summaries, the per-call costs
from two periods, and the extrapolation (bench/serve_bench/poll_cost.py)."""

from __future__ import annotations

import pytest

from serve_bench.poll_cost import (
    LoadCounter,
    Model,
    PollRecord,
    PollSummary,
    Run,
    counter_rates,
    fit_line,
    fit_model,
    parse_records,
    poll_cost,
    poll_summary,
    report,
)


def test_records_parse_and_a_torn_line_is_skipped():
    text = "p 10.5 0.002 4 0\nl 11.0 100 0.01\np 10.6 0.003 3 1\nl 11.25 1"
    polls, loads = parse_records(text)
    assert polls == [PollRecord(10.5, 0.002, 4, 0), PollRecord(10.6, 0.003, 3, 1)]
    assert loads == [LoadCounter(11.0, 100, 0.01)]


def test_counter_rates_use_the_counters_inside_the_window():
    loads = [LoadCounter(0.0, 0, 0.0), LoadCounter(1.0, 100, 0.01), LoadCounter(3.0, 500, 0.05),
             LoadCounter(9.0, 10_000, 1.0)]
    calls, share = counter_rates(loads, 0.5, 5.0)
    assert calls == pytest.approx(200.0)  # (500 - 100) / 2 s
    assert share == pytest.approx(0.02)
    assert counter_rates(loads[:1], 0.0, 5.0) == (0.0, 0.0)


def test_poll_summary_rates_per_router_and_percentiles_over_all_polls():
    # Router A: 10 polls of 1..10 ms in the window; router B: 5 polls of 20 ms, one late.
    a = [PollRecord(1.0 + i * 0.1, (i + 1) / 1000, 2, 0) for i in range(10)]
    b = [PollRecord(1.0 + i * 0.2, 0.020, 1, 1) for i in range(5)]
    outside = [PollRecord(100.0, 5.0, 2, 0)]
    s = poll_summary([a + outside, b], 1.0, 3.0)
    assert s.polls_per_s == pytest.approx((10 / 2 + 5 / 2) / 2)
    assert s.polls_per_s_min == pytest.approx(2.5)
    assert s.rtt_p50_ms == pytest.approx(8.0)  # 15 values: the 8th smallest
    assert s.rtt_p99_ms == pytest.approx(20.0)
    assert s.answers == pytest.approx((10 * 2 + 5 * 1) / 15)
    assert s.late == 5


def _run(routers, replicas, period, polls_per_s, router_cores, engine_cores, calls):
    summary = PollSummary(polls_per_s, polls_per_s, 1.0, 2.0, replicas, 0)
    return Run(routers, replicas, period, 10.0, summary, router_cores, engine_cores, 0.5,
               calls, 0.001)


def test_poll_cost_is_the_cpu_difference_over_the_poll_difference():
    fast = _run(4, 2, 0.02, 50.0, 0.10, 0.08, 200.0)
    slow = _run(4, 2, 1.0, 1.0, 0.051, 0.0604, 4.0)
    c = poll_cost(fast, slow)
    assert c.router_cores == pytest.approx(0.049)
    assert c.router_ms_per_poll == pytest.approx(1.0)  # 0.049 cores / 49 polls/s
    assert c.engine_us_per_call == pytest.approx(100.0)  # 0.0196 cores / 196 calls/s
    same = poll_cost(fast, fast)
    assert same.router_ms_per_poll == 0.0 and same.engine_us_per_call == 0.0


def test_fit_line_and_the_model_extrapolate():
    assert fit_line([1, 2, 4, 8], [1.5, 2.0, 3.0, 5.0]) == pytest.approx((1.0, 0.5))
    assert fit_line([4, 4], [1.0, 3.0]) == (2.0, 0.0)
    m = Model(router_ms_fixed=1.0, router_ms_per_replica=0.5, engine_us=100.0)
    # 64 x 256 at 50 Hz: a router spends (1 + 128) ms per poll, 50 polls a second.
    assert m.router_cores(256, 0.02) == pytest.approx(6.45)
    assert m.engine_cores(64, 0.02) == pytest.approx(0.32)  # 64 x 50 calls x 100 us
    assert m.max_routers(0.02, 0.05) == pytest.approx(10.0)
    assert m.max_replicas(0.02, 0.05) == pytest.approx(0.0)  # 1 ms per poll alone is 5%
    assert m.max_replicas(0.1, 0.05) == pytest.approx(8.0)
    assert Model(0.0, 0.0, 0.0).max_routers(0.02, 0.05) == float("inf")


def test_fit_model_takes_the_engine_cost_from_several_routers_and_report_renders():
    fast = [_run(r, e, 0.02, 50.0, 0.05 + 0.0005 * 50 * e, 0.01 + r * 0.005, r * 50.0)
            for r in (1, 4) for e in (1, 2)]
    slow = [_run(r, e, 1.0, 1.0, 0.05 + 0.0005 * e, 0.01 + r * 0.0001, r * 1.0)
            for r in (1, 4) for e in (1, 2)]
    costs = [poll_cost(f, s) for f, s in zip(fast, slow)]
    m = fit_model(costs)
    assert m.router_ms_per_replica == pytest.approx(0.5)
    assert m.router_ms_fixed == pytest.approx(0.0, abs=1e-9)
    assert m.engine_us == pytest.approx(100.0)
    text = report(fast + slow, 0.02, 1.0, 0.05, [(64, 256)])
    assert "| 4 x 2 |" in text and "| 64 x 256 | 0.02 |" in text and "Break point" in text
