"""Overload: ``factor`` times the engines' capacity in closed-loop clients for ``duration_s``.

Capacity is ``REPLICAS * (BATCH + HEADROOM)``; each client honours Retry-After (capped at 5 s)
as the ``openai`` client does. Bound: the excess is refused (429/503, all with Retry-After) in
under 100 ms at p99 once the first second's connection herd is past; no 500s and no other
failures; no replica restarts; and a probe's latency is back within 1.5x its baseline p50
(plus 50 ms) within ``recovery_bound_s`` of the load ending.
"""

from __future__ import annotations

import asyncio
import time

from serve_bench.chaos.report import Scenario
from serve_bench.chaos.stack import BATCH, HEADROOM, REPLICAS
from serve_bench.chaos.target import Result, Target, client_session, request
from serve_bench.stats import percentile


async def overload(t: Target, factor: int = 5, duration_s: float = 60.0,
                   recovery_bound_s: float = 30.0) -> Scenario:
    capacity = REPLICAS * (BATCH + HEADROOM)
    clients = factor * capacity
    before = await asyncio.to_thread(t.replica_actors)
    async with client_session() as session:
        baseline = [await request(session, t, "chaos-a", stream=False, max_tokens=16)
                    for _ in range(5)]
        base_p50 = percentile([r.latency_s for r in baseline], 50)
        results: list[Result] = []
        stop_at = time.monotonic() + duration_s

        async def client(i: int) -> None:
            # As the openai client does: a refused request is retried after its Retry-After.
            while time.monotonic() < stop_at:
                res = await request(session, t, "chaos-a", stream=i % 2 == 0, max_tokens=32)
                began = stop_at - duration_s
                res.started_s = round(time.monotonic() - began - res.latency_s, 3)
                results.append(res)
                if res.outcome == "refused" and res.retry_after:
                    await asyncio.sleep(min(float(res.retry_after), 5.0))

        await asyncio.gather(*[client(i) for i in range(clients)])
        ended = time.monotonic()
        recovered = None
        probes: list[float] = []
        while time.monotonic() - ended < recovery_bound_s + 30:
            probe = await request(session, t, "chaos-a", stream=False, max_tokens=16)
            probes.append(probe.latency_s)
            if probe.outcome == "ok" and probe.latency_s <= 1.5 * base_p50 + 0.05:
                recovered = time.monotonic() - ended
                break
            await asyncio.sleep(0.5)
    refused = [r for r in results if r.outcome == "refused"]
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
    server_errors = sum(1 for r in results if r.status is not None and r.status >= 500
                        and not (r.status == 503 and r.retry_after))
    restarts = sorted(set(before) ^ set(await asyncio.to_thread(t.replica_actors)))
    figures = {"clients": clients, "capacity_definition": f"{REPLICAS} replicas x (batch "
               f"{BATCH} + headroom {HEADROOM})", "duration_s": duration_s,
               "requests": len(results), "statuses": statuses,
               "served_ok": sum(1 for r in results if r.outcome == "ok"),
               "refused": len(refused),
               "refused_p50_ms": round(1000 * percentile([r.latency_s for r in refused], 50), 1),
               "refused_p99_ms": round(1000 * percentile([r.latency_s for r in refused], 99), 1),
               # The bound applies once the overload runs: the first second is the herd of all
               # clients connecting at the same instant (their figure stays in refused_p99_ms).
               "refused_p99_ms_after_1s": round(1000 * percentile(
                   [r.latency_s for r in refused if r.started_s >= 1.0], 99), 1),
               "refused_without_retry_after": sum(1 for r in refused if not r.retry_after),
               "server_errors": server_errors, "replica_changes": restarts,
               "other_failures": sum(1 for r in results if r.outcome in ("cut", "hung",
                                                                        "error_event", "error")),
               "probe_baseline_p50_ms": round(1000 * base_p50, 1),
               "recovered_after_s": None if recovered is None else round(recovered, 1),
               "probe_latencies_ms": [round(1000 * p, 1) for p in probes],
               "slowest_refusals": sorted(([round(r.started_s, 2), round(1000 * r.latency_s, 1)]
                                           for r in refused), key=lambda x: -x[1])[:20]}
    passed = (bool(refused) and figures["refused_p99_ms_after_1s"] < 100
              and figures["refused_without_retry_after"] == 0 and server_errors == 0
              and not restarts and figures["other_failures"] == 0
              and recovered is not None and recovered <= recovery_bound_s)
    return Scenario("overload", passed, figures, {
        "refused_p99_ms_after_1s": "< 100", "refused_without_retry_after": "0",
        "server_errors": "0",
        "replica_changes": "none", "recovered_after_s": f"<= {recovery_bound_s:g}"})
