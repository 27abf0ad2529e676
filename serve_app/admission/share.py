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

A share is where a router may grow to, not what it holds: a router whose share fell (the load
moved to another router) keeps its long streams until they end. So a router grows only into
the room the engines have free, ``capacity - sum(in_engine)`` over the view, and only into its
part of it (:func:`growth_room`). Without that bound, one router holding 512 long streams and
another getting a backlog sent 768 requests to engines sized for 512, the extra waiting inside
vLLM, outside the fair queue (issue 37, finding 8). With it the routers' growth together stays
within the free room plus one place per router (rounding up), however the load moves, so
their admissions pass the capacity by no more than that and what changed since the demand
reports; a router alone still gets the whole capacity, and a router over its share starts
nothing until it is back under (its completions go to the others).
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


def growth_room(free: int, router_id: str, queued: int, in_flight: int,
                demands: Mapping[str, int], others_in_flight: int, total: int) -> int:
    """How many more requests this router may start now, of the ``free`` places the engines
    have (``capacity - sum(in_engine)``; ``demands`` includes this router): all of it when no
    other router queues, else the larger of

    * ``free`` less what the others could still take: their queued requests
      (``sum(their demands) - others_in_flight``), each within its share;
    * its part of ``free``: half by its queue's fraction of all the routers' queues, half
      evenly over the routers with demand (rounded up).

    The first leaves the others' possible growth in ``free``; the parts of the second sum to
    ``free`` over the routers. So the routers' growth together stays within ``free`` (plus
    one per router), whichever bound each takes. The engines' counts tell what all routers
    have out, the reports only each router's demand (in flight plus queued), so a router
    cannot tell another's queue from its streams; hence the parts."""
    if free <= 0:
        return 0
    others = {rid: d for rid, d in demands.items() if rid != router_id}
    others_queued = max(0, sum(others.values()) - others_in_flight)
    if queued <= 0 or others_queued <= 0:
        return free
    shares = water_fill(total, demands)
    # A router's growth is at most its share less its in-flight; its in-flight is at least its
    # demand less the others' whole queue (the queue could all be its own).
    could_take = sum(max(0.0, shares[rid] - (d - others_queued)) for rid, d in others.items())
    rest = free - min(others_queued, could_take)
    # Its part of the room by its queue, blended with an even part over the routers with
    # demand: a router over its share claims a queue's fraction it will not take (it starts
    # nothing until back under), and by queue alone the room idled behind such claims (load
    # moving back and forth: 86% busy for half a second). Each part sums to ``free`` over
    # the routers, so does the blend.
    fraction = free * queued / (queued + others_queued)
    even = free / sum(1 for d in demands.values() if d > 0)
    return math.ceil(max(rest, (fraction + even) / 2))


def share_of(total: int, replicas: Iterable[EngineLoad], router_id: str, queued: int,
             in_flight: int) -> int:
    """This router's in-flight limit for the model: its :func:`router_share` of ``total`` by
    the demands the ``replicas`` reported, and no more than its ``in_flight`` (those counted
    against the view) plus its :func:`growth_room`. A router over its share gets its share
    (below what it holds: it starts nothing until it is back under); at least
    :data:`COLD_START_PROBE`."""
    replicas = list(replicas)
    demands = router_demands(replicas, router_id, queued + in_flight)
    share = router_share(total, router_id, demands)
    in_engines = sum(r.in_engine for r in replicas)
    free = total - max(in_engines, in_flight)
    others_in_flight = max(0, in_engines - in_flight)
    room = growth_room(free, router_id, queued, in_flight, demands, others_in_flight, total)
    return max(COLD_START_PROBE, min(share, in_flight + room))
