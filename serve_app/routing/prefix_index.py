"""A router's index of which engine replica holds which block hashes: the router side of the
``prefix_cache`` policy.

Built only from what the replicas report on the engine feed (each replica's
:class:`~serve_app.engine.server.ServedBlocks`, as changes since the state this
router said it knew): two routers that have read the same reports hold the same index, so
they choose alike for the same prompt and loads. The feed (:mod:`serve_app.admission.feed`)
asks with :meth:`PrefixIndex.known` and hands each poll's view to :meth:`PrefixIndex.apply`;
a replica that leaves the view takes its entries with it and nothing else's. The request
router reads the index of its model through :func:`index_for` (both run in the router
replica's process; one index per model name there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from serve_app.engine.protocol import EngineLoad, PrefixReport


@dataclass
class _Held:
    """One replica's reported state: its record's ``epoch``, the change count ``seq`` this
    router has applied, and the hashes it holds."""

    epoch: str
    seq: int
    blocks: set[int] = field(default_factory=set)


class PrefixIndex:
    """Replica id -> the block hashes it reported (see the module docstring)."""

    def __init__(self) -> None:
        self._replicas: dict[str, _Held] = {}
        # Each replica's requests as the last view reported them (EngineLoad.in_engine), and
        # the requests this router chose it for since (:meth:`routed`).
        self._loads: dict[str, int] = {}
        self._sent: dict[str, int] = {}
        # The LoRA adapters each replica reported loaded in the last view (EngineLoad.adapters).
        self._adapters: dict[str, frozenset[str]] = {}

    def __len__(self) -> int:
        return len(self._replicas)

    def replicas(self) -> list[str]:
        """The replicas with a reported state."""
        return list(self._replicas)

    def blocks_of(self, replica: str) -> set[int]:
        """The hashes ``replica`` reported (empty when unknown); do not modify."""
        held = self._replicas.get(replica)
        return held.blocks if held is not None else set()

    def known(self) -> dict[str, tuple[str, int]]:
        """Replica id -> (epoch, seq) this router holds: the argument of the feed's poll."""
        return {rid: (h.epoch, h.seq) for rid, h in self._replicas.items()}

    def apply(self, view: Sequence[EngineLoad]) -> None:
        """Take each replica's report of one feed view; forget replicas not in it. A report
        that does not start from the state held (a late answer the feed stood in again, a
        change already applied) is ignored: the next poll asks again from what is held."""
        for load in view:
            if load.prefix_report is not None:
                self.take(load.replica, load.prefix_report)
        self.keep({load.replica for load in view})
        self._loads = {load.replica: load.in_engine for load in view}
        self._adapters = {load.replica: frozenset(load.adapters) for load in view}
        self._sent = {}

    def routed(self, replica: str) -> None:
        """This router chose ``replica`` for a request (counted in its load until the next
        view, which counts it itself once it arrives)."""
        self._sent[replica] = self._sent.get(replica, 0) + 1

    def load(self, replica: str) -> int | None:
        """``replica``'s requests: as the last view reported them, plus those this router has
        chosen it for since; None when it is not in the view. The same figure on every router
        but for their own latest requests (the replicas report it, not each router's own count)."""
        base = self._loads.get(replica)
        return None if base is None else base + self._sent.get(replica, 0)

    def holds_adapter(self, replica: str, adapter: str) -> bool:
        """Whether ``replica`` reported ``adapter`` loaded in the last view."""
        return adapter in self._adapters.get(replica, ())

    def take(self, replica: str, report: PrefixReport) -> bool:
        """Apply one replica's report; whether it was applied."""
        held = self._replicas.get(replica)
        if report.base is None:
            if held is not None and held.epoch == report.epoch and held.seq >= report.seq:
                return False  # an older (or the same) snapshot of what is held
            self._replicas[replica] = _Held(report.epoch, report.seq, set(report.added))
            return True
        if held is None or held.epoch != report.epoch or held.seq != report.base:
            return False
        held.blocks.difference_update(report.removed)
        held.blocks.update(report.added)
        held.seq = report.seq
        return True

    def keep(self, replicas: Iterable[str]) -> None:
        """Forget every replica but ``replicas``: only their own entries go."""
        live = set(replicas)
        for rid in [r for r in self._replicas if r not in live]:
            del self._replicas[rid]

    def matched(self, blocks: Sequence[int], candidates: Sequence[str]) -> dict[str, int]:
        """Per candidate, how many of ``blocks`` (chained hashes, first block first) it holds
        from the first on: its cached prefix in blocks. Reads up to one block past the longest
        match (a chained hash that no candidate holds ends every match)."""
        out = dict.fromkeys(candidates, 0)
        sets = {c: self._replicas[c].blocks for c in candidates if c in self._replicas}
        alive = [c for c in candidates if c in sets]
        for i, h in enumerate(blocks):
            if not alive:
                break
            still = [c for c in alive if h in sets[c]]
            if len(still) != len(alive):
                for c in alive:
                    if c not in still:
                        out[c] = i
                alive = still
        else:
            for c in alive:
                out[c] = len(blocks)
        return out

    def holding(self, h: int, candidates: Sequence[str]) -> set[str]:
        """The candidates that hold hash ``h``."""
        return {c for c in candidates if h in self.blocks_of(c)}


_INDEXES: dict[str, PrefixIndex] = {}


def index_for(model: str) -> PrefixIndex:
    """The index of ``model`` in this process (created empty on first use): written by the
    model's engine feed, read by its request router."""
    index = _INDEXES.get(model)
    if index is None:
        index = _INDEXES[model] = PrefixIndex()
    return index
