"""The replica-choice policy interface of the LLMServer deployment's request router.

A policy is pure: it sees the request's routing key and each candidate replica's load, and says
which replica should get the request, or that the request has nothing to keep together and is
spread by Serve's power-of-two choice. The request router (:mod:`serve_app.routing.pinned`)
gathers the inputs from Serve (candidates, their queue lengths), asks the policy, and turns the
answer into Serve's ranked replica lists. Policies are chosen by name in a model's ``routing:``
config (:class:`serve_app.config.routing.RoutingSettings`); :func:`build_policy` maps the name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from serve_app.engine.protocol import GenerationRequest

# Why a request went where it went (the ``reason`` label of the routing-decision metric):
# affinity       - the replica its (tenant, prefix) key hashes to;
# load_fallback  - that replica was busier than the least-loaded by more than the margin, so the
#                  first replica (in the key's own order) within the margin got it;
# cold           - no key (prompt shorter than one block): spread by power of two;
# power_of_two   - the power_of_two policy: every request spread, keys unused.
Reason = Literal["affinity", "load_fallback", "cold", "power_of_two"]
REASONS: tuple[Reason, ...] = ("affinity", "load_fallback", "cold", "power_of_two")


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
    and loads (no per-router state may change the choice)."""

    name: str

    def key(self, request: GenerationRequest | None) -> bytes | None:
        """The request's affinity key, or None when it has nothing worth keeping together.
        Called once per routing attempt; pure."""

    def needs_load(self) -> bool:
        """Whether :meth:`choose` reads candidates' loads (the router then fetches those it
        does not know before asking)."""

    def choose(self, key: bytes | None, candidates: list[Candidate]) -> Choice:
        """Where the request with ``key`` goes among ``candidates`` (never empty)."""


def build_policy(name: str, **knobs: Any) -> RoutingPolicy:
    """The policy called ``name`` with its knobs; a knob not given takes its default from
    :class:`RoutingSettings`, which also says what each one means (one place for them). Raises
    ValueError, naming the known policies, for an unknown name."""
    from serve_app.config.routing import RoutingSettings
    from serve_app.routing.power_of_two import PowerOfTwo
    from serve_app.routing.prefix_affinity import PrefixAffinity
    from serve_app.routing.prefix_key import PrefixKeyer

    if name == PowerOfTwo.name:
        return PowerOfTwo()
    if name == PrefixAffinity.name:
        k = RoutingSettings(policy=name, **knobs)
        return PrefixAffinity(PrefixKeyer(block_tokens=k.block_tokens, prefix_blocks=k.prefix_blocks,
                                          chars_per_token=k.chars_per_token),
                              imbalance_margin=k.imbalance_margin, load_factor=k.load_factor)
    raise ValueError(f"unknown routing policy {name!r}; use one of: "
                     f"{PowerOfTwo.name}, {PrefixAffinity.name}")
