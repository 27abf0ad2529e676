"""Per-request phases (serve_app.engine.timing): the replica's arithmetic and the header form."""

from types import SimpleNamespace

from serve_app.engine.timing import (
    parse_server_timing,
    replica_phases,
    server_timing_header,
    with_router_phases,
)


def test_replica_phases_from_engine_core_timestamps():
    stats = SimpleNamespace(queued_ts=10.010, scheduled_ts=10.110, first_token_ts=10.250)
    phases = replica_phases(entered=10.000, submitted=10.002, first_output=10.260,
                            engine_stats=stats)
    assert {k: v for k, v in phases.items() if not k.startswith("_")} == {
        "replica": 260.0, "tokenize": 2.0, "to_engine": 8.0, "engine_queue": 100.0,
        "prefill": 140.0, "to_replica": 10.0}


def test_replica_phases_without_engine_stats_keep_what_the_replica_knows():
    assert {k: v for k, v in replica_phases(1.0, 1.5, 2.0, None).items()
            if not k.startswith("_")} == {"replica": 1000.0, "tokenize": 500.0}
    # An engine whose request was never scheduled reports zeros: no made-up engine phases.
    unscheduled = SimpleNamespace(queued_ts=1.2, scheduled_ts=0.0, first_token_ts=0.0)
    assert {k for k in replica_phases(1.0, 1.1, 2.0, unscheduled) if not k.startswith("_")} == \
        {"replica", "tokenize"}


def test_header_round_trip_in_phase_order():
    header = server_timing_header({"prefill": 140.0, "queue": 1.25, "dispatch": 300.0,
                                   "not-a-phase": 5.0})
    assert header == "queue;dur=1.2, dispatch;dur=300.0, prefill;dur=140.0"
    assert parse_server_timing(header) == {"queue": 1.2, "dispatch": 300.0, "prefill": 140.0}


def test_parse_ignores_entries_without_a_duration():
    assert parse_server_timing('cache;desc="hit", db;dur=53, x;dur=oops') == {"db": 53.0}
    assert parse_server_timing(None) == {}


def test_router_phases_split_the_serve_hop_on_one_clock():
    replica = replica_phases(entered=10.0014, submitted=10.0015, first_output=10.0200,
                             engine_stats=None)
    phases = with_router_phases(replica, arrived=9.9990, admitted=9.9993, sent=10.0000,
                                received=10.0205)
    assert phases == {"queue": 0.3, "dispatch": 21.2, "hop_in": 1.4, "hop_out": 0.5,
                      "replica": 18.6, "tokenize": 0.1}
    header = server_timing_header(phases)
    assert header.startswith("queue;dur=0.3, dispatch;dur=21.2, hop_in;dur=1.4, replica;")
    assert header.endswith("hop_out;dur=0.5")


def test_hops_are_dropped_when_the_replica_runs_on_another_clock():
    """Another host's CLOCK_MONOTONIC is unrelated: no made-up hop, the rest stands."""
    replica = replica_phases(entered=500.0, submitted=500.001, first_output=500.02,
                             engine_stats=None)
    phases = with_router_phases(replica, arrived=9.999, admitted=9.9993, sent=10.0,
                                received=10.0205)
    assert "hop_in" not in phases and "hop_out" not in phases
    assert phases["dispatch"] == 21.2 and phases["replica"] == 20.0
    # An engine that reports no phases at all: the router's own.
    assert with_router_phases(None, 1.0, 1.5, 1.6, 2.0) == {"queue": 500.0, "dispatch": 500.0}
