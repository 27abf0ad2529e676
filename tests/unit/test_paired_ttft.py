"""bench/paired_ttft.py's reading of bare vLLM's engine histograms (pure parts)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from serve_app.observability.metrics import vllm_native_name

_SPEC = importlib.util.spec_from_file_location(
    "paired_ttft", Path(__file__).resolve().parents[2] / "bench" / "paired_ttft.py")
paired = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(paired)

EXPOSITION = """\
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 4.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.2
vllm:time_to_first_token_seconds_count{engine="1",model_name="m"} 1.0
vllm:time_to_first_token_seconds_sum{engine="1",model_name="m"} 0.05
# HELP vllm:request_prefill_time_seconds Histogram of prefill time.
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 5.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 0.1
"""


def test_the_bare_names_come_from_the_metric_table():
    assert vllm_native_name("ray_vllm_time_to_first_token_seconds") == \
        "vllm:time_to_first_token_seconds"
    with pytest.raises(ValueError):
        vllm_native_name("ray_serve_replica_processing_queries")
    with pytest.raises(KeyError):
        vllm_native_name("ray_vllm_no_such_metric")


def test_histogram_totals_add_every_engine_and_means_cover_only_the_requests_between():
    after = paired.totals_from_text(EXPOSITION)
    assert after["engine TTFT"] == pytest.approx((0.25, 5.0))
    assert after["engine queue"] == (0.0, 0.0)  # absent series: nothing measured
    before = {"engine TTFT": (0.05, 1.0), "prefill": (0.0, 0.0)}
    means = paired.engine_means(before, after)
    assert means["engine TTFT"] == pytest.approx(50.0)  # (0.25 - 0.05) / 4 requests, in ms
    assert means["prefill"] == pytest.approx(20.0)
    assert "engine queue" not in means  # no request between the scrapes


def test_the_stack_side_means_use_the_same_spans():
    rec = paired.RequestRecord(start=0.0, tenant="t", prompt_tokens=1, output_tokens=1)
    rec.server_timing = {"replica": 12.0, "tokenize": 2.0, "engine_queue": 0.5, "prefill": 8.0}
    bare = paired.RequestRecord(start=0.0, tenant="t", prompt_tokens=1, output_tokens=1)
    means = paired.timing_means([rec, bare])  # a record without Server-Timing is skipped
    assert means == {"engine TTFT": 10.0, "engine queue": 0.5, "prefill": 8.0}


def _rec(ttft: float | None, status: int = 200, **timing: float) -> dict:
    rec = paired.RequestRecord(start=0.0, ttft=ttft, end=1.0, status=status)
    rec.server_timing = dict(timing)
    return rec.to_dict()


def test_pairs_csv_has_one_row_per_answered_pair_with_its_order_and_phases():
    result = {"records": {
        "a": [_rec(0.040), _rec(0.050), _rec(None, status=0), _rec(0.045)],
        "b": [_rec(0.042, hop_in=0.4), _rec(0.049, hop_in=0.5, prefill=35.0),
              _rec(0.041, hop_in=0.4), _rec(0.046, prefill=30.0)],
    }}
    lines = paired.pairs_csv(result, "bare", "stack").splitlines()
    assert lines[0] == "pair,first,bare_ttft_ms,stack_ttft_ms,stack_minus_bare_ms,hop_in,prefill"
    assert lines[1:] == ["0,bare,40.00,42.00,2.00,0.4,",
                         "1,stack,50.00,49.00,-1.00,0.5,35",
                         "3,stack,45.00,46.00,1.00,,30"]  # pair 2: bare gave no answer
