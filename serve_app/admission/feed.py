"""The router's view of one model's engines: polls every live replica's load and turns it into
this router's admission capacity for the model (and reports the router's demand to the
replicas, which pass the backlog on to the autoscaler and every router's demand back to the
routers).

One poll is one call of ``LLMServer.engine_load`` on every replica Serve's handle knows (a few
integers back from each). The answers in hand after ``ANSWER_DEADLINE_S`` make the view; a
replica that answered none of the polls of the last ``POLL_TIMEOUT_S`` drops out of it, and
until then its last answer stands in (its work keeps counting: a replica that flapped out of
the view for one late answer would let the routers admit its in-flight work again). So one slow
replica neither freezes the others' view (with one gather over all answers, every poll took
the slow one's timeout: views fell from 48 to 15 a second, bench/RESULTS.md 27) nor takes its
own work out of the count. A model with no replica has an empty view: its
requests wait in the fair queue, one goes through to wake Serve's autoscaler
(:data:`~serve_app.admission.policy.COLD_START_PROBE`), and after ``cold_start_timeout_s``
they are answered 503, at once when the model's replica cannot be placed
(:class:`PlacementCheck`). The poll runs every :meth:`EngineFeed.busy_period` while the model has
requests in flight (``poll_interval_s``, longer with many routers so that each replica answers
at most ``engine_polls_per_s`` polls a second), at once when requests start to queue, and
every ``idle_poll_interval_s`` otherwise.
Nothing here is on the per-token path: requests are admitted and released by the admission
controller as they arrive and end; the feed only moves the limit and the view.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence

from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from serve_app.admission.controller import AdmissionController
from serve_app.admission.policy import CapacityPolicy
from serve_app.admission.share import share_of
from serve_app.config import AdmissionSettings
from serve_app.engine.protocol import EngineLoad
from serve_app.routing.prefix_index import PrefixIndex, index_for
from serve_app.serve_private import (
    autoscaler_node_types,
    broadcast_each,
    replica_placement_groups,
)

logger = logging.getLogger(__name__)

POLL_TIMEOUT_S = 2.0  # a replica silent this long is not live for admission
# Answers wait together this long; a replica's engine_load is a few integers from its event
# loop (about a millisecond), so only a stuck or overloaded replica misses it.
ANSWER_DEADLINE_S = 0.25
# The busy poll period never grows past this: the simulation (bench/RESULTS.md 27d) holds every
# admission bar at 8 x 32 and 64 x 256 with 0.1 s views; at 0.25 s, 64 x 256 let the engines'
# waiting pass the headroom and a scale-up's worst second fall to 94%. Beyond 5 routers per
# model a replica then answers more than engine_polls_per_s (64 routers: about 0.9 of a core,
# 27b); pushing the load on the output channels is the way past that.
BUSY_PERIOD_CAP_S = 0.1
# While the model has no live replica and requests wait, its placement is checked this often
# (one GCS read of the placement groups and nodes, off the event loop).
PLACEMENT_CHECK_PERIOD_S = 1.0


@dataclass(frozen=True)
class PlacementFacts:
    """What the cluster says about placing a model's replicas: ``groups`` are Serve's placement
    groups of its replicas (``ray.util.placement_group_table`` entries), ``nodes`` the total
    resources of each live node, ``node_types`` those of each node type an autoscaler may add
    (None: none is reported, see :func:`~serve_app.serve_private.autoscaler_node_types`)."""

    groups: list[dict[str, Any]]
    nodes: list[dict[str, float]]
    node_types: list[dict[str, float]] | None


def _fits(bundles: list[dict[str, float]], strategy: str,
          nodes: list[dict[str, float]]) -> bool:
    """Whether some node shape of ``nodes`` can hold the group: all of it on one node under
    STRICT_PACK, each bundle on some node otherwise (PACK spills over nodes)."""
    def holds(node: dict[str, float], need: dict[str, float]) -> bool:
        return all(node.get(key, 0.0) >= amount for key, amount in need.items() if amount > 0)

    if strategy == "STRICT_PACK":
        return any(holds(node, _total(bundles)) for node in nodes)
    return all(any(holds(node, bundle) for node in nodes) for bundle in bundles)


def _total(resources: list[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for item in resources:
        for key, amount in item.items():
            total[key] = total.get(key, 0.0) + float(amount)
    return total


def _shown(resources: dict[str, float], keys: Sequence[str]) -> str:
    return ", ".join(f"{resources.get(k, 0.0):g} {k}" for k in keys) or "nothing"


def cannot_place(facts: PlacementFacts) -> str | None:
    """Why the model's replica cannot be placed, or None while it may be. It cannot when the
    GCS found its placement group infeasible (no node of the cluster can hold it, decided at
    its first scheduling attempt) and no autoscaler may add a node that could."""
    for group in facts.groups:
        if group.get("state") not in ("PENDING", "RESCHEDULING"):
            continue
        if group.get("stats", {}).get("scheduling_state") != "INFEASIBLE":
            continue
        bundles = [dict(b) for b in group.get("bundles", {}).values()]
        strategy = str(group.get("strategy", "PACK"))
        if facts.node_types is not None and _fits(bundles, strategy, facts.node_types):
            return None  # the autoscaler may add a node that holds it
        asked = _total(bundles)
        keys = sorted(k for k, v in asked.items() if v > 0)
        largest = max(facts.nodes, key=lambda n: tuple(n.get(k, 0.0) for k in keys),
                      default={})
        grows = "" if facts.node_types is None else "; its autoscaler adds no node that could"
        return (f"its replica asks for {_shown(asked, keys)} ({len(bundles)} bundle(s), "
                f"{strategy}) and no node can hold it (the largest node has "
                f"{_shown(largest, keys)}; the cluster has {_shown(_total(facts.nodes), keys)} "
                f"in {len(facts.nodes)} node(s){grows})")
    return None


def read_placement(app: str, deployment: str) -> PlacementFacts | None:
    """The cluster's :class:`PlacementFacts` for ``deployment`` of ``app`` (blocking GCS reads:
    call it off the event loop); None outside a Ray worker."""
    import ray

    if not ray.is_initialized():
        return None
    nodes = [{k: float(v) for k, v in n.get("Resources", {}).items()}
             for n in ray.nodes() if n.get("Alive")]
    return PlacementFacts(replica_placement_groups(app, deployment), nodes,
                          autoscaler_node_types())


class EngineFeed:
    """Keeps ``admission.capacity`` and its view in step with the live replicas of ``model``."""

    def __init__(self, model: str, handle: DeploymentHandle, admission: AdmissionController,
                 policy: CapacityPolicy, settings: AdmissionSettings, router_id: str,
                 on_poll: Callable[[str, Sequence[EngineLoad], int], None] | None = None,
                 placement: Callable[[], Awaitable[PlacementFacts | None]] | None = None
                 ) -> None:
        """``placement`` reads the cluster's :class:`PlacementFacts` for the model (default:
        :func:`read_placement` in a thread, for the handle's deployment)."""
        self.model = model
        self.handle = handle
        self.admission = admission
        self.policy = policy
        self.settings = settings
        self.router_id = router_id
        self.replicas: list[EngineLoad] = []  # as of the last successful poll
        self.polled_at = 0.0
        self._on_poll = on_poll or (lambda *_: None)
        self._task: asyncio.Task[None] | None = None
        self._failures = 0
        self._answered: dict[str, tuple[EngineLoad, float]] = {}  # replica -> last answer, when
        self.held = 0  # answers stood in for a late replica, since start (admission_state)
        # Why the model's replica cannot be placed (None: it may be, or nobody waits); set
        # together with ``placement_failed``, which a request sent while cold waits on.
        self.unplaceable: str | None = None
        self.placement_failed = asyncio.Event()
        self._placement = placement or self._read_placement
        self._placement_task: asyncio.Task[None] | None = None
        self._placement_checked = 0.0
        # What each replica's prefix cache holds, as the replicas report it (the prefix_cache
        # routing policy's view, serve_app/routing/prefix_index.py): asked for and kept
        # current by every poll.
        self.prefix_index: PrefixIndex = index_for(model)

    def start(self) -> None:
        """Start polling on the running event loop (idempotent)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def poll(self) -> list[EngineLoad] | None:
        """The view of one poll (:meth:`view_of`; [] when the model has no replica), or None
        when the poll itself failed (the previous view then stands)."""
        a = self.admission
        try:
            results = await broadcast_each(self.handle, "engine_load", self.router_id,
                                           a.queued(), a.in_flight, self.prefix_index.known(),
                                           timeout_s=POLL_TIMEOUT_S,
                                           answer_timeout_s=ANSWER_DEADLINE_S)
        except DeploymentUnavailableError:  # no replica: an empty view, not a stale one
            self._failures = 0
            self._answered.clear()
            return []
        except Exception as err:  # the deployment being redeployed, a poll that hung, ...
            self._failures += 1
            if self._failures in (1, 10) or self._failures % 100 == 0:
                logger.warning("load poll of %s failed (%d in a row): %r", self.model,
                               self._failures, err)
            return None
        self._failures = 0
        # A replica that raised (dying, stopping) is not live for admission; one that was
        # late may be for a while.
        late = sum(isinstance(r, asyncio.TimeoutError) for r in results)
        return self.view_of([r for r in results if isinstance(r, EngineLoad)], late,
                            time.monotonic())

    def busy_period(self) -> float:
        """The poll period while the model has work: ``poll_interval_s``, or longer (up to
        ``BUSY_PERIOD_CAP_S``) when the routers that reported to the replicas (the last view's
        demands) would together poll each replica more than ``engine_polls_per_s`` times a
        second. Admission itself does not wait for a poll: a finished request frees its place
        at once."""
        routers = max((len(r.router_demand) for r in self.replicas[:1]), default=1)
        return max(self.settings.poll_interval_s,
                   min(BUSY_PERIOD_CAP_S, routers / self.settings.engine_polls_per_s))

    def view_of(self, answers: list[EngineLoad], late: int, now: float) -> list[EngineLoad]:
        """The view from one poll at ``now``: every replica that answered, then the last answer
        of up to ``late`` replicas that were in the view, did not answer this time and did
        answer within ``POLL_TIMEOUT_S`` (the most recent first). A broadcast's late answers
        carry no replica id; a replica Serve took out of its set is not called, so it is not
        among the ``late`` and drops out at once."""
        for load in answers:
            self._answered[load.replica] = (load, now)
        answered = {load.replica for load in answers}
        missing = sorted(((load, at) for rid, (load, at) in self._answered.items()
                          if rid not in answered and now - at <= POLL_TIMEOUT_S),
                         key=lambda item: -item[1])[:late]
        self._answered = {load.replica: (load, at) for load, at in missing} | {
            rid: self._answered[rid] for rid in answered}
        self.held += len(missing)
        return answers + [load for load, _ in missing]

    def apply(self, replicas: list[EngineLoad]) -> int:
        """Set this router's admission capacity, view and prefix index from ``replicas``;
        returns the capacity."""
        self.replicas = replicas
        self.prefix_index.apply(replicas)
        self.polled_at = time.monotonic()
        a = self.admission
        total = self.policy.capacity(replicas)
        live = {r.replica for r in replicas}  # own work off the view counts not (controller)
        counted = a.in_flight - sum(w for r, w in a.on_replica.items() if r not in live)
        capacity = share_of(total, replicas, self.router_id, a.queued(), counted)
        a.set_capacity(capacity, live=[r.replica for r in replicas])
        if not replicas:  # cold start: bound how long a request waits for the first replica
            a.expire_waiting(self.settings.cold_start_timeout_s)
        self._on_poll(self.model, replicas, capacity)
        return capacity

    async def _run(self) -> None:
        while True:
            try:
                replicas = await self.poll()
                if replicas is not None:
                    self.apply(replicas)
                elif not self.replicas:  # no answer and none known: still a cold start
                    self.admission.expire_waiting(self.settings.cold_start_timeout_s)
                self._watch_placement()
                a = self.admission
                if a.in_flight or len(a.queue):
                    await asyncio.sleep(self.busy_period())
                else:  # idle: wake on the next queue (a burst) or the idle timer
                    try:
                        await asyncio.wait_for(a.blocked.wait(),
                                               self.settings.idle_poll_interval_s)
                    except asyncio.TimeoutError:
                        pass
            except asyncio.CancelledError:
                raise
            except Exception:  # never let the feed die: admission would freeze
                logger.exception("engine feed of %s failed; retrying", self.model)
                await asyncio.sleep(self.settings.idle_poll_interval_s)

    def _watch_placement(self) -> None:
        """While the model has no live replica and requests wait, check at most every
        ``PLACEMENT_CHECK_PERIOD_S`` (one check at a time) whether its replica can be placed;
        the verdict holds only while they wait. An unplaceable model's waiting requests fail
        at once (:meth:`_placed`)."""
        a = self.admission
        if self.replicas or not (a.in_flight or len(a.queue)):
            self.unplaceable = None
            self.placement_failed.clear()
            return
        if self.unplaceable is not None:  # requests that queued since the verdict
            a.expire_waiting(-1.0, self.unplaceable)
        now = time.monotonic()
        if (self._placement_task is None or self._placement_task.done()) \
                and now - self._placement_checked >= PLACEMENT_CHECK_PERIOD_S:
            self._placement_checked = now
            self._placement_task = asyncio.get_running_loop().create_task(self._check())

    async def _check(self) -> None:
        try:
            facts = await self._placement()
        except Exception as err:  # the check is advice: without it requests wait as before
            logger.warning("placement check of %s failed: %r", self.model, err)
            return
        reason = cannot_place(facts) if facts is not None else None
        a = self.admission
        if self.replicas or not (a.in_flight or len(a.queue)):
            return  # a replica came or nobody waits any more: the verdict is stale
        if reason is not None and self.unplaceable is None:
            logger.warning("%s cannot be placed: %s", self.model, reason)
        self.unplaceable = reason
        if reason is None:
            self.placement_failed.clear()
            return
        self.placement_failed.set()
        a.expire_waiting(-1.0, reason)

    async def _read_placement(self) -> PlacementFacts | None:
        return await asyncio.to_thread(read_placement, self.handle.app_name,
                                       self.handle.deployment_name)
