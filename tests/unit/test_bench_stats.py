"""Benchmark metrics on synthetic timings, with vllm bench serve's definitions."""

import random

import pytest

from serve_bench.stats import (
    SLO,
    RequestRecord,
    percentile,
    service_over_time,
    summarize,
    summarize_by_tenant,
)
from serve_bench.workload import gamma_arrivals, parse_length, parse_tenants, plan


def _rec(start, ttft, gaps, tokens, tenant="a", status=200):
    end = start + ttft + sum(gaps)
    return RequestRecord(start=start, tenant=tenant, prompt_tokens=10, output_tokens=tokens,
                         ttft=ttft, itl=list(gaps), end=end, status=status)


def test_percentile_matches_numpy_linear():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 90) == pytest.approx(4.6)
    assert percentile(xs, 99) == pytest.approx(4.96)
    assert percentile([], 50) == 0.0


def test_tpot_excludes_first_token():
    r = _rec(0.0, 0.1, [0.02] * 9, 10)
    assert r.e2el == pytest.approx(0.28)
    assert r.tpot == pytest.approx(0.02)  # (0.28 - 0.1) / (10 - 1)
    assert _rec(0.0, 0.1, [], 1).tpot is None


def test_summary_throughput_and_latency():
    recs = [_rec(0.0, 0.1, [0.01] * 4, 5), _rec(0.0, 0.3, [0.03] * 4, 5),
            RequestRecord(start=0.0, status=429, error="rate limited")]
    s = summarize(recs, duration_s=2.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["failures_by_status"] == {"429": 1}
    assert s["total_output_tokens"] == 10 and s["output_throughput"] == 5.0
    assert s["total_input_tokens"] == 20 and s["total_token_throughput"] == 15.0
    assert s["request_throughput"] == 1.0
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["ttft_ms"]["median"] == pytest.approx(200.0)
    assert s["tpot_ms"]["median"] == pytest.approx(20.0)
    assert s["itl_ms"]["mean"] == pytest.approx(20.0)
    assert s["e2el_ms"]["p99"] == pytest.approx(417.2)  # 140 + 0.99 * (420 - 140)


def test_goodput_counts_requests_meeting_every_slo():
    recs = [_rec(0.0, 0.1, [0.01] * 4, 5), _rec(0.0, 0.3, [0.01] * 4, 5),
            _rec(0.0, 0.1, [0.09] * 4, 5)]
    s = summarize(recs, 1.0, SLO(ttft_ms=200, tpot_ms=50))
    assert s["goodput"] == 1.0  # only the first meets both


def test_connection_errors_are_failures():
    s = summarize([RequestRecord(start=0.0, error="ClientConnectorError: refused")], 1.0)
    assert s["failed"] == 1 and s["failures_by_status"] == {"ClientConnectorError": 1}
    assert s["output_throughput"] == 0.0


def test_per_tenant_and_service_over_time():
    recs = [_rec(0.0, 0.5, [0.5], 2, "a"), _rec(0.0, 0.5, [1.5], 4, "b")]
    by = summarize_by_tenant(recs, 2.0)
    assert by["a"]["total_output_tokens"] == 2 and by["b"]["total_output_tokens"] == 4
    series = service_over_time(recs, t0=0.0, bin_s=1.0)
    assert sum(series["a"]) == pytest.approx(2.0)
    assert sum(series["b"]) == pytest.approx(4.0)
    # b's 4 tokens spread over 0.5..2.0 s: a third in the first bin, two thirds in the second
    assert series["b"][:2] == pytest.approx([4 / 3, 8 / 3])


def test_gamma_arrivals_mean_rate_and_burstiness():
    rng = random.Random(0)
    poisson = gamma_arrivals(4000, rate=20.0, burstiness=1.0, rng=rng)
    gaps = [b - a for a, b in zip(poisson, poisson[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(0.05, rel=0.05)
    regular = gamma_arrivals(4000, rate=20.0, burstiness=50.0, rng=rng)
    rgaps = [b - a for a, b in zip(regular, regular[1:])]
    var = lambda xs: sum((x - sum(xs) / len(xs)) ** 2 for x in xs) / len(xs)  # noqa: E731
    assert var(rgaps) < var(gaps) / 10


def test_plan_exact_lengths_shares_and_seed():
    tenants = parse_tenants(["a:key-a:3", "b::1"])
    p = plan(400, (32, 32), parse_length("16-64"), tenants, (10, 250), seed=1)
    assert all(len(r.prompt_token_ids) == 32 for r in p)
    assert all(16 <= r.max_tokens <= 64 for r in p)
    assert all(10 <= t < 250 for r in p for t in r.prompt_token_ids)
    share_a = sum(r.tenant.name == "a" for r in p) / len(p)
    assert 0.68 < share_a < 0.82
    assert p == plan(400, (32, 32), (16, 64), tenants, (10, 250), seed=1)
    assert tenants[1].api_key is None


@pytest.mark.parametrize("bad", ["0", "9-3", "x"])
def test_bad_lengths(bad):
    with pytest.raises(ValueError):
        parse_length(bad)


def test_bad_tenant_spec():
    with pytest.raises(ValueError):
        parse_tenants(["just-a-name"])


def test_a_tenant_may_name_its_model():
    """A fourth field is the model the tenant's requests name (a LoRA adapter: issue 39's mix
    of tenants each on its own adapter); adapter names may hold colons."""
    a, b, c = parse_tenants(["a:key-a:3:tune-a", "b::1", "c:k:1:org/tune:v2"])
    assert (a.name, a.api_key, a.share, a.model) == ("a", "key-a", 3.0, "tune-a")
    assert b.model is None
    assert c.model == "org/tune:v2"
    p = plan(40, (4, 4), (2, 2), [a, b], (10, 250), seed=1)
    assert {r.tenant.model for r in p} == {"tune-a", None}


@pytest.mark.parametrize("bad", ["a:k", "a:k:1:", "a:k:x:m"])
def test_bad_tenant_specs_with_a_model(bad):
    with pytest.raises(ValueError):
        parse_tenants([bad])


def test_recorded_command_never_holds_api_keys():
    from serve_bench.runner import redact_keys

    argv = ["--tenant", "a:sk-sa-secret:2", "--tenant=b:sk-sa-other:1", "--tenant", "c::1",
            "--concurrency", "4"]
    out = " ".join(redact_keys(argv))
    assert "secret" not in out and "other" not in out
    assert "a:***:2" in out and "--tenant=b:***:1" in out and "c::1" in out and "4" in out
    argv = ["--tenant", "a:sk-sa-secret:2:tune-a", "--tenant=b:sk-sa-other:1:org/t:v2",
            "--tenant", "c::1:tune-c"]
    out = redact_keys(argv)
    assert out == ["--tenant", "a:***:2:tune-a", "--tenant=b:***:1:org/t:v2", "--tenant",
                   "c::1:tune-c"]


def test_paired_difference_recovers_the_gap_under_shared_drift():
    """The machine drifts over 10 ms, five times the 2 ms gap between the servers; each pair
    shares its moment, so the median of the per-pair differences recovers the gap with an
    interval under 0.5 ms wide (unpaired, the drift alone spreads each median by ms)."""
    import random

    from serve_bench.stats import paired_difference

    rng = random.Random(3)
    drift = [30 + 10 * rng.random() for _ in range(64)]  # 30..40 ms, shared within a pair
    a = [d + rng.gauss(0, 0.2) for d in drift]
    b = [d + 2.0 + rng.gauss(0, 0.2) for d in drift]
    s = paired_difference(a, b)
    assert s["pairs"] == 64
    assert abs(s["diff_p50"] - 2.0) < 0.15
    assert s["diff_p50_ci_low"] < 2.0 < s["diff_p50_ci_high"]
    assert s["diff_p50_ci_high"] - s["diff_p50_ci_low"] < 0.5
    assert s["b_slower_share"] > 0.95


def test_paired_difference_refuses_unpaired_samples():
    import pytest

    from serve_bench.stats import paired_difference

    with pytest.raises(ValueError):
        paired_difference([1.0, 2.0], [1.0])
    assert paired_difference([], []) == {"pairs": 0}
