"""Per-request phases (serve_app.engine.timing): the replica's arithmetic and the header form."""

from types import SimpleNamespace

from serve_app.engine.timing import parse_server_timing, replica_phases, server_timing_header


def test_replica_phases_from_engine_core_timestamps():
    stats = SimpleNamespace(queued_ts=10.010, scheduled_ts=10.110, first_token_ts=10.250)
    phases = replica_phases(entered=10.000, submitted=10.002, first_output=10.260,
                            engine_stats=stats)
    assert phases == {"replica": 260.0, "tokenize": 2.0, "to_engine": 8.0,
                      "engine_queue": 100.0, "prefill": 140.0, "to_replica": 10.0}


def test_replica_phases_without_engine_stats_keep_what_the_replica_knows():
    assert replica_phases(1.0, 1.5, 2.0, None) == {"replica": 1000.0, "tokenize": 500.0}
    # An engine whose request was never scheduled reports zeros: no made-up engine phases.
    unscheduled = SimpleNamespace(queued_ts=1.2, scheduled_ts=0.0, first_token_ts=0.0)
    assert set(replica_phases(1.0, 1.1, 2.0, unscheduled)) == {"replica", "tokenize"}


def test_header_round_trip_in_phase_order():
    header = server_timing_header({"prefill": 140.0, "queue": 1.25, "dispatch": 300.0,
                                   "not-a-phase": 5.0})
    assert header == "queue;dur=1.2, dispatch;dur=300.0, prefill;dur=140.0"
    assert parse_server_timing(header) == {"queue": 1.2, "dispatch": 300.0, "prefill": 140.0}


def test_parse_ignores_entries_without_a_duration():
    assert parse_server_timing('cache;desc="hit", db;dur=53, x;dur=oops') == {"db": 53.0}
    assert parse_server_timing(None) == {}
