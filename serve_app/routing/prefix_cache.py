"""The ``prefix_cache`` routing policy: a request goes to the replica that holds the longest
prefix of its prompt in its prefix cache, weighed against the load it would join.

What each replica holds is the router's :class:`~serve_app.routing.prefix_index.PrefixIndex`,
built from the replicas' own records of what they served (carried on the engine feed), so
every router reads the same index. A request's prompt is cut into chained block hashes salted
by tenant (:mod:`serve_app.routing.prefix_blocks`); a replica's match is how many of them it
holds from the first. Turn k+1 of a conversation begins with turn k's prompt, so it matches
the replica where turn k ran over its whole history, and another replica only over what they
share (a system prompt).

The choice, as Dynamo's KV router and llm-d's scorers weigh prefill saved against load, and as
SGLang's cache-aware router keeps cache affinity only while the load is balanced:

* Load bound (the same as ``prefix_affinity``'s): a replica may take the request while, with
  it, it holds at most ``load_factor`` times the candidates' mean load, or at most
  ``imbalance_margin`` requests above the least-loaded. Replicas past it rank after all others.
* Score: matched blocks, plus ``max_blocks`` on a replica holding the request's session key
  (``prompt_cache_key``/``user``: it outranks any prompt match), less
  ``request_cost_tokens / block_tokens`` per request of load more than ``LOAD_SLACK`` above the
  least-loaded candidate. The highest score wins; equal scores go to the less loaded, then by
  rendezvous order of the request's first hash (or its session), the same on every router.
  The slack: a conversation's next turn is sent as its last one ends, while its replica may
  still count that one (Serve's queue length drops when the stream closes, after the client
  has its answer); on the CPU test a turn hopped away from its history on that one request.
* So a prompt cached nowhere goes to the least-loaded replica (reason ``spread``); a new
  session whose system prompt every replica caches is spread by load (the match is equal); a
  conversation's next turn stays where its history is while the history outweighs the load
  (``affinity``), else goes elsewhere (``load_fallback``).

Loads are what the replicas report on the engine feed (requests they serve, ``in_engine``), plus the
requests this router has chosen each for since (:meth:`PrefixIndex.load`), counted as it chooses (a
burst of new sessions decided before Serve sent any went to one replica): the same figures on every
router, fresh within a poll. Serve's queue lengths, which ``prefix_affinity`` reads, are each
router's own cache (refreshed by its own traffic, or after 10 s): on the CPU test a router that had
sent nothing to a busy replica saw it idle and sent a session there. A replica the feed has not
reported yet (just started: nothing cached) counts as the least-loaded; the policy asks for
no Serve figures (``needs_load`` is False). A request without any whole
block and without a session key has no key: Serve's power of two spreads it (``cold``).
"""

from __future__ import annotations

from typing import Callable

from serve_app.engine.protocol import GenerationRequest
from serve_app.routing.policy import Candidate, Choice
from serve_app.routing.prefix_affinity import load_bound, rendezvous_order
from serve_app.routing.prefix_blocks import BlockHasher, PromptBlocks
from serve_app.routing.prefix_index import PrefixIndex


# Requests of load above the least-loaded that cost nothing (see the module docstring).
LOAD_SLACK = 1


class PrefixCache:
    """Longest cached prefix against load, within the load bound (module docstring)."""

    name = "prefix_cache"

    def __init__(self, hasher: BlockHasher, index: Callable[[], PrefixIndex], *,
                 imbalance_margin: int = 4, load_factor: float = 1.25,
                 request_cost_tokens: int = 64) -> None:
        """``index`` gives the index to read at each choice (the model's, in the router)."""
        if imbalance_margin < 0 or request_cost_tokens < 0:
            raise ValueError("imbalance_margin and request_cost_tokens must be at least 0")
        if load_factor < 1:
            raise ValueError("load_factor must be at least 1")
        self.hasher = hasher
        self.index = index
        self.imbalance_margin = imbalance_margin
        self.load_factor = load_factor
        self.request_cost_blocks = request_cost_tokens / hasher.block_tokens

    def key(self, request: GenerationRequest | None) -> PromptBlocks | None:
        """The request's hashes, computed on its first routing attempt and written into it
        (``prefix_hashes``: the session's hash first, then the blocks', which the serving
        replica records); a later attempt reads them back. None: no block and no session."""
        if request is None:
            return None
        hashes = request.prefix_hashes
        if hashes is None or request.prefix_block_tokens != self.hasher.block_tokens:
            found = self.hasher.of(request)
            hashes = ((found.session,) if found.session is not None else ()) + found.blocks
            request.prefix_hashes = hashes
            request.prefix_block_tokens = self.hasher.block_tokens
            return found if hashes else None
        if not hashes:
            return None
        if request.session:
            return PromptBlocks(hashes[1:], hashes[0])
        return PromptBlocks(hashes, None)

    def needs_load(self, key: object) -> bool:
        return False  # the engine feed's loads (module docstring), not Serve's probes

    def routed(self, replica_id: str) -> None:
        self.index().routed(replica_id)

    def choose(self, key: object | None, candidates: list[Candidate]) -> Choice:
        if not isinstance(key, PromptBlocks) or not candidates:
            return Choice("cold")
        ids = [c.replica_id for c in candidates]
        index = self.index()
        matched = index.matched(key.blocks, ids)
        if key.session is not None:
            for rid in index.holding(key.session, ids):
                matched[rid] += self.hasher.max_blocks
        load = {c.replica_id: (index.load(c.replica_id) if index.load(c.replica_id) is not None
                               else c.load) for c in candidates}
        known = [v for v in load.values() if v is not None]
        low = min(known) if known else 0
        bound = load_bound(known, self.imbalance_margin, self.load_factor)
        first = (key.session if key.session is not None else key.blocks[0]).to_bytes(8, "big")
        tie = {rid: i for i, rid in enumerate(rendezvous_order(first, ids))}

        def rank(rid: str) -> tuple[bool, float, int, int]:
            v = load[rid] if load[rid] is not None else low
            over = bound is not None and v > bound
            cost = self.request_cost_blocks * max(0, v - low - LOAD_SLACK)
            return (over, cost - matched[rid], v, tie[rid])

        ranked = tuple(sorted(ids, key=rank))
        best = max(matched.values())
        if best == 0:
            return Choice("spread", ranked)
        if matched[ranked[0]] == best:
            return Choice("affinity", ranked)
        return Choice("load_fallback", ranked)
