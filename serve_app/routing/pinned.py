"""The LLMServer deployment's Serve request router: calls that name the replica they must reach
go there; every request goes where the model's routing policy says.

A router replica opens its output channel (:mod:`serve_app.engine.channel`) on one specific
engine replica, the one serving its requests; Serve's handles have no call for that, but they
ask the deployment's request router where each call goes. A call with a ``target_replica``
keyword goes to that replica only, or waits while it is not a candidate (not yet running, or
stopping: the caller bounds the wait). Every other call (every request) is routed by the
model's policy (:mod:`serve_app.routing.policy`, ``routing:`` of the model's config, passed
here by Serve as ``request_router_kwargs``): ``power_of_two`` is Serve's own choice;
``prefix_affinity`` sends a (tenant, prefix) key to the replica rendezvous hashing gives it,
bounded by the candidates' queue lengths; ``prefix_cache`` sends it to the replica holding the
longest cached prefix of the prompt, weighed against load (:mod:`serve_app.routing.prefix_cache`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    RequestRouter,
    RunningReplica,
)

from serve_app.config.routing import RoutingSettings
from serve_app.engine.protocol import GenerationRequest
from serve_app.routing import build_policy
from serve_app.routing.policy import Candidate, Reason, RoutingPolicy
from serve_app.serve_private import (
    PowerOfTwoChoicesRequestRouter,
    probe_queue_lens,
    request_backoff,
)

logger = logging.getLogger(__name__)

TARGET_KWARG = "target_replica"
ROUTER_CLASS = "serve_app.routing.pinned:PinnedOrPolicyRouter"
# How long a choice counts in its replica's load while Serve has not routed its request: far
# beyond a send's round trip (milliseconds), short enough that a request cancelled before it
# was sent stops counting soon.
UNSENT_TTL_S = 1.0


def pinned_target(pending_request: PendingRequest | None) -> str | None:
    """The replica id a call names in ``target_replica``, if any."""
    if pending_request is None:
        return None
    target: Any = pending_request.kwargs.get(TARGET_KWARG)
    return target if isinstance(target, str) else None


def routed_request(pending_request: PendingRequest | None) -> GenerationRequest | None:
    """The :class:`GenerationRequest` a ``generate`` call carries (its first argument), if any."""
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    return first if isinstance(first, GenerationRequest) else None


class DecisionCounter:
    """The routing-decision metric (``ray_serve_app_routing_decisions_total``, by model and
    reason), registered on first use: a request router is built in every process that holds a
    handle, most of which route nothing."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._counter: Any = None

    def record(self, reason: Reason) -> None:
        if self._counter is None:
            from ray.serve.metrics import Counter

            from serve_app.observability.metrics import METRICS, ROUTER_METRICS, exported_name

            name = ROUTER_METRICS["routing_decisions"]
            self._counter = Counter(name, description=METRICS[exported_name(name, "counter")].help,
                                    tag_keys=("model", "reason"))
        self._counter.inc(1, tags={"model": self.model, "reason": reason})


class UnsentChoices:
    """The replicas this router chose for requests that Serve has not routed yet.

    Serve counts a request in a replica's queue length when it sends it, and learns the real
    figure from the replica's answer; the policy is told of a request (``routed``) when the
    router chooses. Decisions taken together (a burst: each awaits the same probe, or each is
    taken before the previous one's request is sent) all read the same loads otherwise, so a
    load bound let the whole burst through to one replica (12 of 12 in the prefix-affinity
    spill test). The router adds these counts to Serve's loads it gives the policy. A
    request's choice ends when Serve routes it (``on_request_routed``; until then it may count
    twice, once here and once in Serve's cache: a replica looks busier for one round trip,
    never idler), when the request is routed again (its new choice replaces it), or after
    ``UNSENT_TTL_S`` (a request cancelled before it was sent)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # id of the pending request -> (its replica, when chosen, the request: kept so that its
        # id cannot be reused while the entry lives)
        self._chosen: dict[int, tuple[str, float, object]] = {}

    def chose(self, pending_request: object, replica_id: str) -> bool:
        """Record the choice; whether it is new (not this request's standing choice). Stale
        choices go here too: a policy that reads no loads never asks for the counts."""
        self._drop_stale()
        standing = self._chosen.pop(id(pending_request), None)  # re-inserted: oldest first
        self._chosen[id(pending_request)] = (replica_id, self._clock(), pending_request)
        return standing is None or standing[0] != replica_id

    def _drop_stale(self) -> None:
        # Entries are in the order chosen, so this reads the stale ones and one more: a
        # saturated model's requests, waiting in Serve's queue and chosen again at each of
        # its retries, cost no scan of all the others.
        oldest = self._clock() - UNSENT_TTL_S
        while self._chosen:
            key = next(iter(self._chosen))
            if self._chosen[key][1] >= oldest:
                break
            del self._chosen[key]

    def forget(self, pending_request: object) -> None:
        """End the request's choice (Serve routed it)."""
        self._chosen.pop(id(pending_request), None)

    def counts(self, but: object | None = None) -> dict[str, int]:
        """Replica id -> choices still unsent (stale ones dropped), leaving out request
        ``but``'s own (a retry's earlier choice is not load it joins)."""
        self._drop_stale()
        skip = id(but) if but is not None else None
        counts: dict[str, int] = {}
        for key, (replica_id, _, _) in self._chosen.items():
            if key != skip:
                counts[replica_id] = counts.get(replica_id, 0) + 1
        return counts


class PinnedOrPolicyRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Honours ``target_replica``; otherwise the configured routing policy.

    Serve's default router also has the FIFO mixin, which hands a chosen replica to the oldest
    waiting call, not to the call it was chosen for: a pinned call could then be sent to the
    replica chosen for another, and a request to the replica chosen for another's prefix.
    Without it each call gets the replica chosen for it."""

    policy: RoutingPolicy
    decisions: Any
    unsent: UnsentChoices

    def initialize_state(self, model: str = "", **routing: Any) -> None:
        """Called by Serve with the deployment's ``request_router_kwargs``: the model's
        ``routing:`` settings (:meth:`RoutingSettings.router_kwargs`) and its name. Settings
        not given take :class:`RoutingSettings`' defaults (a bare router: all of them)."""
        settings = RoutingSettings.model_validate(routing)
        self.policy = build_policy(settings.policy, model,
                                   **settings.model_dump(exclude={"policy"}))
        self.decisions = DecisionCounter(model)
        self.unsent = UnsentChoices()

    def _policy(self) -> RoutingPolicy:
        # Serve calls initialize_state right after construction; tests may build bare routers.
        if not hasattr(self, "policy"):
            self.initialize_state()
        return self.policy

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        target = pinned_target(pending_request)
        if target is not None:
            pinned = [r for r in candidate_replicas if r.replica_id.unique_id == target]
            return [pinned] if pinned else []
        policy = self._policy()
        key = policy.key(routed_request(pending_request))
        loads: dict[str, int | None] = {}
        if key is not None and policy.needs_load(key):
            loads = await self._loads(candidate_replicas)
            # Read after the await: the choices taken while it waited count; a retry's own
            # earlier choice does not.
            for rid, n in self._unsent().counts(but=pending_request).items():
                if loads.get(rid) is not None:
                    loads[rid] = loads[rid] + n  # type: ignore[operator]
        choice = policy.choose(key, [Candidate(r.replica_id.unique_id,
                                               loads.get(r.replica_id.unique_id))
                                     for r in candidate_replicas])
        try:
            self.decisions.record(choice.reason)
        except Exception:  # a metric must never fail a request
            logger.debug("routing decision metric failed", exc_info=True)
        if not choice.ranked:
            return await PowerOfTwoChoicesRequestRouter.choose_replicas(
                self, candidate_replicas, pending_request)  # type: ignore[arg-type]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if pending_request is not None:
            if choice.ranked[0] in by_id and self._unsent().chose(pending_request,
                                                                  choice.ranked[0]):
                self._tell_policy(choice.ranked[0])  # once per request and replica
            # Every candidate is in the ranks: when all refuse, Serve must back off before
            # asking again (without it, it asks again at once, in a busy loop).
            request_backoff(pending_request)
        return [[by_id[rid]] for rid in choice.ranked if rid in by_id]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any,
                          result: Any) -> None:
        """Serve's hook once a call was sent to ``replica_id``: Serve's cache counts it now,
        so the router's own count of the request ends (the policy was told at the choice)."""
        if pinned_target(pending_request) is not None:
            return
        self._unsent().forget(pending_request)

    def _tell_policy(self, replica_id: str) -> None:
        try:
            self._policy().routed(replica_id)
        except Exception:  # bookkeeping must never fail a request
            logger.debug("routing policy's routed() failed", exc_info=True)

    def _unsent(self) -> UnsentChoices:
        if not hasattr(self, "unsent"):  # a bare router (tests) gets it on first use
            self.unsent = UnsentChoices()
        return self.unsent

    async def _loads(self, replicas: list[RunningReplica]) -> dict[str, int | None]:
        """Each replica's queue length: from Serve's cache, else probed now (Serve's probe,
        bounded by its response deadline); None for a replica that did not answer."""
        cache = self.replica_queue_len_cache
        loads: dict[str, int | None] = {}
        unknown = []
        for r in replicas:
            n = cache.get(r.replica_id)
            if n is None:
                unknown.append(r)
            loads[r.replica_id.unique_id] = n
        if unknown:
            for r, n in await probe_queue_lens(self, unknown):
                loads[r.replica_id.unique_id] = n
        return loads
