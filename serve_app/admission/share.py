"""How several router replicas share one model's capacity: by the demand each holds, max-min
fair (water-filling), not by their count.

Each router reports its demand for the model (requests in flight plus requests queued) to every
engine replica with its load poll, and every replica answers with all the fresh reports
(:attr:`serve_app.engine.protocol.EngineLoad.router_demand`), so each router sees every
router's demand without a call of its own to shared state. A router whose demand is below an
even split gets all of it; what it leaves goes to the routers that want more, evenly. So a
router alone with the load (uneven HAProxy spread, a pinned client connection, the other router
restarting) gets the whole engine, and a router with any demand gets at least its even part of
what the others leave: none starves. A fixed split by the number of routers left the engine
idle while one router queued (2 routers: 20 of 512 running).

Between two polls the routers' views differ by what changed since; the sum of the shares can
pass the model's capacity by one poll's growth, which the engines' small waiting queues absorb.
Pure functions (no Ray); unit-tested.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

from serve_app.admission.policy import COLD_START_PROBE
from serve_app.engine.protocol import EngineLoad


# Every router reports to every replica it polls, so any replica holds every router's demand;
# a few answers cover a replica that joined since the last poll. Merging all of them cost
# routers x replicas per poll (4-5 ms at 64 routers x 256 replicas, bench/RESULTS.md 27).
DEMAND_SAMPLE = 3


def router_demands(replicas: Sequence[EngineLoad], router_id: str, own_demand: int
                   ) -> dict[str, int]:
    """Every router's demand as the first ``DEMAND_SAMPLE`` replicas reported it (the largest
    report of each, if they disagree), with this router's own figure taken live."""
    demands: dict[str, int] = {}
    for replica in replicas[:DEMAND_SAMPLE]:
        for rid, demand in replica.router_demand:
            demands[rid] = max(demands.get(rid, 0), demand)
    demands[router_id] = own_demand
    return demands


def water_fill(total: int, demands: Mapping[str, int]) -> dict[str, float]:
    """Max-min fair split of ``total`` over ``demands``: each gets at most its demand, and what
    the smaller ones leave is split evenly among the larger. With no demand at all, an even
    split (a router that gets a request then may start it)."""
    if not demands:
        return {}
    if sum(demands.values()) <= 0:
        return {rid: total / len(demands) for rid in demands}
    shares: dict[str, float] = {}
    left = float(total)
    ordered = sorted(demands.items(), key=lambda kv: kv[1])
    for i, (rid, demand) in enumerate(ordered):
        even = left / (len(ordered) - i)
        shares[rid] = min(float(demand), even) if i < len(ordered) - 1 else left
        left -= shares[rid]
    return shares


def router_share(total: int, router_id: str, demands: Mapping[str, int]) -> int:
    """This router's in-flight limit for the model: its water-filled part of ``total``, rounded
    up, and at least :data:`COLD_START_PROBE`."""
    shares = water_fill(total, demands)
    return max(COLD_START_PROBE, math.ceil(shares.get(router_id, 0.0)))


def share_of(total: int, replicas: Iterable[EngineLoad], router_id: str, own_demand: int) -> int:
    """:func:`router_share` of ``total`` by the demands the ``replicas`` reported."""
    return router_share(total, router_id, router_demands(list(replicas), router_id, own_demand))
