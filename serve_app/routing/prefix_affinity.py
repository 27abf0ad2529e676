"""The ``prefix_affinity`` routing policy: a tenant's shared prefix goes to the replica that
holds it in its prefix cache, bounded by load.

Where a key lives is decided by rendezvous (highest-random-weight) hashing: every candidate
replica gets the weight hash(key, replica id), and the key's replicas in order of weight are
its preference list. Why rendezvous and not an index of what each engine caches (vLLM's
KV-cache events, as llm-d's precise scorer and Dynamo do):

* every router replica computes the same list from the key and the replica ids alone: no
  shared state, no per-request call, nothing to keep consistent when a router restarts;
* a replica added or removed moves only the keys whose first choice it is (about 1/n of
  them), so the caches that are warm stay useful;
* the engines' KV events would need a subscriber per router and an index that can lag
  behind evictions; the key already says where a prefix was sent, which is where vLLM
  cached it unless it was evicted since.

Load bound: Serve's queue length of each candidate (requests sent and not finished). A
replica may take the request when, with it, it holds at most ``load_factor`` times the mean
load of the candidates (consistent hashing with bounded loads, Mirrokni, Thorup and
Zadimoghaddam; HAProxy's ``hash-balance-factor``), or at most ``imbalance_margin`` requests
above the least-loaded candidate (which decides at small loads, where one request is a large
part of the mean). The request goes to the first replica of the key's list within that bound
(with two replicas: the key's own, else the other). Following the key's own list, not just the
least load, sends a hot prefix's overflow to the same second replica from every router, where
it gets cached too. A replica whose load is unknown counts as within the bound (Serve probes a
replica it knows nothing of before sending to it).

Why a bound relative to the mean and not the margin alone: on the H200 (two replicas, 32
streams, 64 shared prefixes; bench/RESULTS.md 31) the keys' own split is uneven by a few
requests at any moment, so a margin of 4 sent a large part of the requests to the other
replica, which then cached the same prefixes: hit rate 0.46 where routing by prefix alone
reached 0.94.
"""

from __future__ import annotations

import hashlib

from serve_app.engine.protocol import GenerationRequest
from serve_app.routing.policy import Candidate, Choice
from serve_app.routing.prefix_key import PrefixKeyer


def rendezvous_order(key: bytes, replica_ids: list[str]) -> list[str]:
    """``replica_ids`` by decreasing rendezvous weight for ``key`` (deterministic, the same in
    every process: no Python hash, whose seed differs per process)."""
    return sorted(replica_ids, key=lambda rid: (_weight(key, rid), rid), reverse=True)


def load_bound(loads: list[int], imbalance_margin: int, load_factor: float) -> float | None:
    """The most a replica may hold before it takes one more request, from the candidates'
    known ``loads`` (the module's docstring): the larger of ``imbalance_margin`` above the
    least-loaded and ``load_factor`` times the mean with the request. None when no load is
    known (then every replica counts as within it). The bound of every load-bounded policy
    (``prefix_affinity``, ``prefix_cache``, adapter placement)."""
    if not loads:
        return None
    return max(min(loads) + imbalance_margin,
               load_factor * (sum(loads) + 1) / len(loads) - 1)


def _weight(key: bytes, replica_id: str) -> int:
    h = hashlib.blake2b(key, digest_size=8)
    h.update(replica_id.encode())
    return int.from_bytes(h.digest(), "big")


class PrefixAffinity:
    """Rendezvous hashing of (tenant salt, leading prompt blocks), bounded by load; requests
    without a key are spread by Serve's power-of-two choice (reason ``cold``)."""

    name = "prefix_affinity"

    def __init__(self, keyer: PrefixKeyer, *, imbalance_margin: int = 4,
                 load_factor: float = 1.25) -> None:
        if imbalance_margin < 0:
            raise ValueError("imbalance_margin must be at least 0")
        if load_factor < 1:
            raise ValueError("load_factor must be at least 1")
        self.keyer = keyer
        self.imbalance_margin = imbalance_margin
        self.load_factor = load_factor

    def key(self, request: GenerationRequest | None) -> bytes | None:
        return self.keyer.key(request)

    def needs_load(self, key: object) -> bool:
        return True

    def routed(self, replica_id: str) -> None:
        pass

    def choose(self, key: object | None, candidates: list[Candidate]) -> Choice:
        if not isinstance(key, bytes) or not candidates:
            return Choice("cold")
        load = {c.replica_id: c.load for c in candidates}
        order = rendezvous_order(key, list(load))
        bound = load_bound([v for v in load.values() if v is not None],
                           self.imbalance_margin, self.load_factor)

        def within(rid: str) -> bool:
            v = load[rid]
            return bound is None or v is None or v <= bound

        if within(order[0]):
            return Choice("affinity", tuple(order))
        # The least-loaded candidate is within the margin, so there is always one.
        spill = next(rid for rid in order if within(rid))
        return Choice("load_fallback", (spill, *(rid for rid in order if rid != spill)))
