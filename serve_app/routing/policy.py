"""The replica-choice policy interface of the LLMServer deployment's request router.

A policy is pure: it sees the request's routing key and each candidate replica's load, and says
which replica should get the request, or that the request has nothing to keep together and is
spread by Serve's power-of-two choice. The request router (:mod:`serve_app.routing.pinned`)
gathers the inputs from Serve (candidates, their queue lengths), asks the policy, and turns the
answer into Serve's ranked replica lists. Policies are chosen by name in a model's ``routing:``
config (:class:`serve_app.config.routing.RoutingSettings`); the registry that maps the name is
the package's face (:func:`serve_app.routing.build_policy`). This module imports no policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from serve_app.engine.protocol import GenerationRequest

# Why a request went where it went (the ``reason`` label of the routing-decision metric):
# affinity       - prefix_affinity: the replica its (tenant, prefix) key hashes to;
#                  prefix_cache: the replica holding the longest cached prefix (or the session);
# load_fallback  - that replica was past the load bound (or, prefix_cache, its load outweighed
#                  the prefill it saves), so another got it;
# spread         - prefix_cache: no replica holds any of its blocks: the least-loaded;
# cold           - no key (prompt shorter than one block): spread by power of two;
# power_of_two   - the power_of_two policy: every request spread, keys unused.
Reason = Literal["affinity", "load_fallback", "spread", "cold", "power_of_two"]
REASONS: tuple[Reason, ...] = ("affinity", "load_fallback", "spread", "cold", "power_of_two")


@dataclass(frozen=True, slots=True)
class Candidate:
    """A replica the request may go to, and its load as this router last knew it.

    ``replica_id``: Serve's unique id of the replica (the same string on every router).
    ``load``: requests Serve counts on the replica (its queue length: sent and not finished);
    None when unknown (no fresh answer from the replica).
    """

    replica_id: str
    load: int | None


@dataclass(frozen=True, slots=True)
class Choice:
    """A policy's answer. ``ranked``: replica ids best first (the request router tries them in
    that order, a replica that refuses the request passing it to the next); empty: spread the
    request by Serve's power-of-two choice."""

    reason: Reason
    ranked: tuple[str, ...] = ()


@runtime_checkable
class RoutingPolicy(Protocol):
    """Chooses the engine replica of one request. Called by the request router, on its event
    loop, once per routing attempt of every request that names no ``target_replica``; must
    return at once (no I/O) and give the same answer on every router replica for the same key
    and loads (no state may change the choice but what every router learns alike: the
    replicas' own reports of their caches, :mod:`serve_app.routing.prefix_index`)."""

    name: str

    def key(self, request: GenerationRequest | None) -> object | None:
        """The request's affinity key (of the policy's own type), or None when it has nothing
        worth keeping together. Called once per routing attempt; depends on the request only.
        A policy may write what it derived into the request for the serving replica (the
        ``prefix_cache`` policy's block hashes) and reuse it on a later attempt."""

    def needs_load(self, key: object) -> bool:
        """Whether :meth:`choose` reads candidates' loads for ``key`` (never None: a request
        without a key is not asked about); the router then fetches those it does not know
        before asking."""

    def choose(self, key: object | None, candidates: list[Candidate]) -> Choice:
        """Where the request with ``key`` goes among ``candidates`` (never empty)."""

    def routed(self, replica_id: str) -> None:
        """The router chose ``replica_id`` for a request: told once per request and replica,
        as the router decides, before Serve sends it, so the next decision counts it (a burst
        decided before any is sent must not all read the same loads); not for calls that name
        their replica. Must return at once and never raise."""
