"""`serve-app chaos` starts the embedded default reshaped for its scenarios (pure parts)."""

from __future__ import annotations

from serve_bench import chaos
from serve_app.config import DEFAULT_CONFIG, load_config
from serve_app.governance.keys import key_digest


def test_chaos_config_two_small_replicas_short_queue_and_two_tenants():
    cfg, keys = chaos.chaos_config(load_config(DEFAULT_CONFIG), port=8123)
    model = cfg.models[0]
    assert model.engine_kwargs["max_num_seqs"] == chaos.BATCH
    assert model.autoscaling.min_replicas == model.autoscaling.max_replicas == chaos.REPLICAS
    assert cfg.router.port == 8123 and cfg.router.max_queued_per_band == chaos.QUEUE
    assert cfg.router.admission.headroom == chaos.HEADROOM
    # Slow readers are cut within the scenario's few minutes, and the limit is the caller's.
    assert cfg.router.stream_stall_timeout_s == chaos.STALL_S
    assert chaos.chaos_config(load_config(DEFAULT_CONFIG), 8123, 2.5)[0] \
        .router.stream_stall_timeout_s == 2.5
    assert {t.name: t.priority for t in cfg.tenants} == chaos.TENANTS
    for tenant in cfg.tenants:  # only digests in the config; the keys stay with the driver
        assert tenant.api_key_sha256 == [key_digest(keys[tenant.name])]


def test_report_names_every_bound_and_verdict():
    s = chaos.Scenario("overload", False, {"refused_p99_ms": 140.0}, {
        "refused_p99_ms": "< 100", "server_errors": "0"})
    text = chaos._markdown([s], "serve-app chaos")
    assert "## overload: FAIL" in text
    assert "| refused_p99_ms | 140.0 | < 100 |" in text and "| (server_errors) | | 0 |" in text
