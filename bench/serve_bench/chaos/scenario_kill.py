"""Replica kill: one of the engine replicas is killed under ``streams`` concurrent streams.

Bound: only requests in flight on the victim fail (at most its batch and headroom, ``BATCH +
2 * HEADROOM``), each with a terminal signal (an SSE error event, or a 503 with Retry-After
before any byte); none hangs, is cut silently or gets another error; Serve's replacement
serves a probe stream again (its time from the kill is recorded); and no engine process is
left orphaned (``serve_app.launch.find_leftovers``).
"""

from __future__ import annotations

import asyncio
import time

from serve_bench.chaos.report import Scenario
from serve_bench.chaos.stack import BATCH, HEADROOM, REPLICAS, TENANTS
from serve_bench.chaos.target import Target, client_session, request, wait_until


async def replica_kill(t: Target, streams: int = 50, kill_after_s: float = 3.0,
                       max_tokens: int = 300) -> Scenario:
    from serve_app.launch import find_leftovers

    before = await asyncio.to_thread(t.replica_actors)
    async with client_session() as session:
        tasks = [asyncio.create_task(request(session, t, list(TENANTS)[i % 2], stream=True,
                                             max_tokens=max_tokens, timeout_s=300))
                 for i in range(streams)]
        await asyncio.sleep(kill_after_s)
        victim = before[0]
        in_flight_at_kill = await asyncio.to_thread(t.admission)
        await asyncio.to_thread(t.kill_replica, victim)
        killed_at = time.monotonic()
        results = await asyncio.gather(*tasks)
    outcomes = {k: sum(1 for r in results if r.outcome == k)
                for k in ("ok", "error_event", "refused", "error", "cut", "hung")}
    refused_without_retry = sum(1 for r in results if r.outcome == "refused"
                                and not r.retry_after)
    # Serve replaces the victim: time until the model has two engines that answer again.
    back = await asyncio.to_thread(
        wait_until, lambda: len(t.replica_actors()) == REPLICAS and victim not in t.replica_actors()
        and len(t.engines()) == REPLICAS, 600, 0.5)
    replaced_s = None if back is None else round(time.monotonic() - killed_at, 1)
    probe = None
    if back is not None:
        async with client_session() as session:
            probe = await request(session, t, "chaos-a", stream=True, max_tokens=8)
    # An engine core whose replica died must go with it (no GPU held by an orphan).
    await asyncio.to_thread(wait_until, lambda: not find_leftovers(), 30, 0.5)
    orphans = [f"{p.what} ({p.pid})" for p in find_leftovers()]
    failed = outcomes["error_event"] + outcomes["refused"] + outcomes["error"]
    victim_bound = BATCH + 2 * HEADROOM  # what one replica runs and holds at once
    figures = {"streams": streams, "killed_after_s": kill_after_s,
               "router_in_flight_at_kill": in_flight_at_kill["in_flight"], **outcomes,
               "refused_without_retry_after": refused_without_retry,
               "replacement_serving_after_s": replaced_s,
               "probe_after_replacement": probe.outcome if probe else None,
               "orphaned_engine_processes": orphans}
    passed = (outcomes["hung"] == 0 and outcomes["cut"] == 0 and outcomes["error"] == 0
              and refused_without_retry == 0 and failed <= victim_bound and replaced_s is not None
              and probe is not None and probe.outcome == "ok" and not orphans)
    return Scenario("replica kill", passed, figures, {
        "hung + cut + error": "0", "failed (error events + 503s)": f"<= {victim_bound} (the "
        "victim's batch and queue)", "replacement": "serves again", "orphans": "none"})
