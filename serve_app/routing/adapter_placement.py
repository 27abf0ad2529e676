"""Adapter placement: a LoRA adapter's requests go to the replicas that report it loaded, on
at most ``adapter_replicas`` of them; wraps the model's policy (any of them), which still
routes every request that names no adapter.

Each replica reports the adapters its engine holds (:attr:`EngineLoad.adapters`, its LRU of
``max_cpu_loras`` names) on the engine feed, which every router reads into the model's
:class:`~serve_app.routing.prefix_index.PrefixIndex`: the same facts on every router, so they
choose alike. For a request naming adapter A, among the candidates:

* A's order: rendezvous order of A's key over the candidates (the same on every router).
  A's holders: the candidates that report A loaded, in that order, the first
  ``adapter_replicas`` of them (more may still report it from earlier traffic: they are not
  sent more, and their LRU drops it).
* A's placement: its holders, then the first candidates of A's order that do not hold it, up
  to ``adapter_replicas`` replicas in all. It is fixed by the view, not by this router's sends:
  within a burst, before the feed reports a replica that began loading A as a holder, the
  overflow still goes to that replica, never to a third one.
* The request goes to the first replica of the placement within the load bound
  (``prefix_affinity``'s bound: at most ``load_factor`` x the mean load with it, or
  ``imbalance_margin`` above the least-loaded) - the first, not the least-loaded, so that when
  A's traffic falls back under the bound it all goes to one replica again and the others' LRU
  drops A (shrinking). Reason ``affinity`` where that replica holds A (or A is held nowhere
  and it is the first of A's order), ``load_fallback`` where it will load A (growing).
* Every replica of the placement past the bound: the least-loaded of them (the request waits
  there rather than load A on one more replica).

A replica's load is the higher of the engine feed's figure (:meth:`PrefixIndex.load`: the same
on every router, fresh within a poll; it counts this router's sends since the poll only where
the wrapped policy tells the index, as ``prefix_cache`` does) and Serve's queue length of the
candidate (this router's own, counting its latest sends; the router fetches it for every
adapter request): within a burst between two polls, the feed alone would send every request
to the adapter's first replica. Unknown counts as within the bound. The wrapped policy's key
is still computed for an adapter's request (``prefix_cache`` writes its hashes into the
request for the serving replica's record).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from serve_app.engine.protocol import GenerationRequest
from serve_app.routing.policy import Candidate, Choice, RoutingPolicy
from serve_app.routing.prefix_affinity import load_bound, rendezvous_order
from serve_app.routing.prefix_index import PrefixIndex
from serve_app.routing.prefix_key import adapter_key


@dataclass(frozen=True, slots=True)
class AdapterKey:
    """The routing key of a request naming an adapter: its name and rendezvous key."""

    name: str
    digest: bytes


class AdapterPlacement:
    """``inner`` for requests without an adapter; adapter placement (module docstring) for
    those with one. Same name as ``inner`` (the config names the policy)."""

    def __init__(self, inner: RoutingPolicy, index: Callable[[], PrefixIndex], *,
                 adapter_replicas: int = 2, imbalance_margin: int = 4,
                 load_factor: float = 1.25) -> None:
        if adapter_replicas < 1:
            raise ValueError("adapter_replicas must be at least 1")
        if imbalance_margin < 0:
            raise ValueError("imbalance_margin must be at least 0")
        if load_factor < 1:
            raise ValueError("load_factor must be at least 1")
        self.inner = inner
        self.name = inner.name
        self.index = index
        self.adapter_replicas = adapter_replicas
        self.imbalance_margin = imbalance_margin
        self.load_factor = load_factor

    def key(self, request: GenerationRequest | None) -> object | None:
        inner = self.inner.key(request)  # prefix_cache's hashes go into the request
        if request is not None and request.adapter is not None:
            return AdapterKey(request.adapter[0], adapter_key(request.adapter[0]))
        return inner

    def needs_load(self, key: object) -> bool:
        # An adapter's placement reads Serve's queue lengths, which count this router's latest
        # sends whatever the wrapped policy (power_of_two tells the index nothing).
        return isinstance(key, AdapterKey) or self.inner.needs_load(key)

    def routed(self, replica_id: str) -> None:
        self.inner.routed(replica_id)

    def choose(self, key: object | None, candidates: list[Candidate]) -> Choice:
        if not isinstance(key, AdapterKey):
            return self.inner.choose(key, candidates)
        if not candidates:
            return Choice("cold")
        index = self.index()
        load = {c.replica_id: _higher(index.load(c.replica_id), c.load) for c in candidates}
        order = rendezvous_order(key.digest, list(load))
        holders = [rid for rid in order if index.holds_adapter(rid, key.name)]
        holders = holders[:self.adapter_replicas]
        placement = holders + [rid for rid in order
                               if rid not in holders][:self.adapter_replicas - len(holders)]
        bound = load_bound([v for v in load.values() if v is not None],
                           self.imbalance_margin, self.load_factor)

        def within(rid: str) -> bool:
            v = load[rid]
            return bound is None or v is None or v <= bound

        pick = next((rid for rid in placement if within(rid)), None)
        if pick is None:
            pick = min(placement, key=lambda rid: (load[rid] if load[rid] is not None else 0,
                                                   placement.index(rid)))
        ranked = (pick, *(rid for rid in placement if rid != pick),
                  *(rid for rid in order if rid not in placement))
        grows = pick not in (holders or order[:1])
        return Choice("load_fallback" if grows else "affinity", ranked)


def _higher(a: int | None, b: int | None) -> int | None:
    """The higher of two load figures, either of which may be unknown (None)."""
    return b if a is None else a if b is None else max(a, b)
