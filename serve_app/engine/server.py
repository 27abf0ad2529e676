"""LLMServer: the Ray Serve deployment that owns one engine per replica.

The engine class is injected (an import path), so tests can run the whole deployment with a
stand-in engine while production uses :class:`serve_app.engine.vllm_adapter.VLLMEngine`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
import uuid
from collections import OrderedDict, deque
from typing import Any, AsyncIterator

from serve_app.config import ModelSettings
from serve_app.engine.adapter_swaps import count_swaps
from serve_app.engine.channel import Batch, OutputChannels
from serve_app.engine.protocol import (
    Engine,
    EngineLoad,
    GenerationRequest,
    PrefixReport,
    WireChunk,
)
from serve_app.engine.router_reports import RouterReports
from serve_app.engine.timing import CACHED_TOKENS
from serve_app.observability import tracing

logger = logging.getLogger(__name__)

DEFAULT_ENGINE_CLASS = "serve_app.engine.vllm_adapter:VLLMEngine"
# The prefix record's size for an engine that does not say how many tokens its KV cache holds.
DEFAULT_CACHE_TOKENS = 262_144


def import_engine_class(path: str) -> type:
    """Resolve ``"module:Class"`` into the class."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


class LLMServer:
    """One replica: loads the engine at construction and streams its output.

    Methods are called by Ray Serve through deployment handles: ``generate`` by the router for
    every request (streaming); ``engine_load`` by every router replica, broadcast to all replicas
    many times a second (its admission feed); ``check_health`` and ``record_autoscaling_stats``
    by Serve every few seconds.
    """

    async def __init__(self, settings: dict[str, Any], engine_class: str = DEFAULT_ENGINE_CLASS,
                       swap_metric: str = "") -> None:
        """``swap_metric``: the registered name of the adapter-swap counter (the metric
        table's, passed by serve_app/app.py: :mod:`serve_app.engine.adapter_swaps` says why);
        empty: not counted."""
        self.settings = ModelSettings.model_validate(settings)
        self.engine: Engine = import_engine_class(engine_class)(self.settings)
        self.active = 0  # generate() calls in progress: tokenizing, in the engine, streaming
        self.requests_total = 0  # generate() calls taken since the replica started
        self.reports = RouterReports()  # the router replicas' demand for this model
        self.replica_id = _replica_id()
        self.node_id = _node_id()
        self.channels = OutputChannels()
        # The prefix_cache policy's record of what this replica's engine caches; made with
        # the first request that carries block hashes (:meth:`_record`).
        self.served: ServedBlocks | None = None
        self.record_error = RecordError()
        # LoRA adapter loads and evictions, in the metric table's adapter_swaps counter.
        self.adapter_swaps = count_swaps(self.engine, swap_metric, self.settings.name)
        tracing.configure(tracing.settings_from_env(), "engine")  # off: nothing is set up
        await self.engine.start()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[WireChunk]:
        """Stream the engine's chunks for ``request`` in their wire form
        (:meth:`GenerationChunk.from_wire` reads them); cancellation aborts the engine's work.

        With ``request.reply_to`` (a router replica's id) only the first chunk, which names
        this replica, comes back here; the later ones go through that router's output channel
        (:mod:`serve_app.engine.channel`) while this stream stays open until the engine is
        done with the request."""
        self.active += 1
        self.requests_total += 1
        predicted = None
        if request.prefix_hashes:
            # Counted as cached from now: the engine caches the prompt as it prefills it, and
            # a non-streaming request's first chunk comes only at its end.
            predicted = self._record(request)
        router = request.reply_to
        first = True
        span = tracing.engine_span(request)  # None while tracing is off
        chunks = self.engine.generate(request)
        try:
            if router is not None:
                self.channels.begin(router)
            async for chunk in chunks:
                if first:
                    first = False
                    chunk.replica = self.replica_id
                    tracing.engine_first(span, chunk)
                    if predicted is not None and chunk.timing is not None:
                        self.record_error.add(predicted, chunk.timing.get(CACHED_TOKENS),
                                              chunk.prompt_tokens)
                    yield chunk.to_wire()
                elif router is not None:
                    self.channels.push(router, request.request_id, chunk.to_wire())
                else:
                    yield chunk.to_wire()
        finally:
            self.active -= 1
            tracing.engine_end(span, first)
            if router is not None:
                self.channels.end(router)
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:  # cancelled or failed mid-way: the engine stops now
                await aclose()

    async def channel(self, router_id: str, target_replica: str) -> AsyncIterator[Batch]:
        """The output channel of router replica ``router_id`` on this replica: batches of
        ``(request_id, wire chunk)``. ``target_replica`` is this replica's id; the LLMServer's
        request router (:mod:`serve_app.routing.pinned`) sends the call here by it."""
        if target_replica != self.replica_id:  # the pin failed: never read another's outbox
            raise RuntimeError(f"channel for replica {target_replica} reached "
                               f"{self.replica_id}")
        try:
            async for batch in self.channels.stream(router_id):
                yield batch
        except (asyncio.CancelledError, GeneratorExit):
            # The router is gone (a channel that ends by itself or is replaced returns; one
            # whose router died is cancelled): its demand must not hold its share.
            self.reports.forget(router_id)
            raise

    async def model_info(self) -> dict[str, Any]:
        """Facts the router needs about the served model."""
        return {"name": self.settings.name, "max_model_len": self.engine.max_model_len}

    async def engine_load(self, router_id: str | None = None, router_queued: int = 0,
                          router_in_flight: int = 0,
                          prefix_known: dict[str, tuple[str, int]] | None = None
                          ) -> EngineLoad:
        """This replica's load, for the routers' admission and for tests (cheap, no I/O).

        A router calling it (broadcast to every replica) also reports how many requests of this
        model it holds in its queue and has in flight: the replicas pass the backlog on to the
        autoscaler, and every router's demand back to the routers, which share the model's
        capacity by it. With ``prefix_known`` (replica id -> the (epoch, seq) of its prefix
        record the router holds: :meth:`serve_app.routing.prefix_index.PrefixIndex.known`)
        the answer carries this replica's record since that state, once it has one."""
        if router_id is not None:
            self.reports.record(router_id, router_queued, router_in_flight)
        report = None
        if prefix_known is not None and self.served is not None:
            report = self.served.report(prefix_known.get(self.replica_id))
        return dataclasses.replace(self.load(), router_demand=self.reports.demand(),
                                   prefix_report=report)

    def _record(self, request: GenerationRequest) -> int:
        """Count ``request``'s block hashes as cached (its prompt is going into the engine);
        returns the prompt tokens the record held already (its leading blocks found, the
        session's hash aside): the prediction :class:`RecordError` checks. The record holds
        the engine's KV cache in blocks of the request's size."""
        size = max(1, request.prefix_block_tokens)
        if self.served is None:
            self.served = ServedBlocks(max(1, _kv_cache_tokens(self.engine) // size))
        hashes = request.prefix_hashes or ()
        blocks = hashes[1:] if request.session else hashes
        held = next((i for i, h in enumerate(blocks) if h not in self.served), len(blocks))
        self.served.record(hashes)
        return held * size

    async def prefix_record_stats(self) -> dict[str, float]:
        """How well this replica's record of served blocks predicted its engine's prefix-cache
        hits, since the replica started (:class:`RecordError`); for bench/gpu_prefix_affinity.sh."""
        return self.record_error.as_dict()

    def load(self) -> EngineLoad:
        """The engine's load with this replica's own fields filled in."""
        load = self.engine.load()
        unfinished = getattr(self.engine, "unfinished_requests", None)
        return dataclasses.replace(
            load, replica=self.replica_id, node=self.node_id, active=self.active,
            requests_total=self.requests_total,
            unfinished=unfinished() if unfinished else load.running + load.waiting)

    async def engine_started_order(self) -> list[str]:
        """Request ids in the order this replica's engine started them, where the engine
        records it (the scripted engine, for ordering tests); empty otherwise."""
        order = getattr(self.engine, "started_order", None)
        return order() if order else []

    async def engine_hold_steps(self, held: bool) -> bool:
        """Hold (True) or release (False) the engine's step loop where the engine has that
        control (the scripted engine, for ordering tests); returns whether it has. Returns
        once a held loop has stopped between steps."""
        hold = getattr(self.engine, "hold_steps", None)
        if hold is None:
            return False
        await hold(held)
        return True

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Custom metrics for :mod:`serve_app.autoscaling` (Serve calls this every
        ``metrics_interval_s``). ``in_engine``: this replica's own requests; ``router_queued``:
        the model's backlog in the routers, the same figure on every replica."""
        return {"in_engine": float(self.load().in_engine),
                "router_queued": float(self.reports.backlog())}

    async def check_health(self) -> None:
        """Raise when the engine is dead; a busy engine is healthy (no request is issued)."""
        await self.engine.check_health()

    async def __del__(self) -> None:
        # The constructor may have failed before the engine existed.
        engine = getattr(self, "engine", None)
        if engine is not None:
            await engine.shutdown()


def _kv_cache_tokens(engine: Any) -> int:
    """Tokens the engine's KV cache holds: its ``kv_cache_tokens`` (the vLLM adapter reads
    vLLM's cache config; the scripted engine has none), else :data:`DEFAULT_CACHE_TOKENS`."""
    tokens = getattr(engine, "kv_cache_tokens", None)
    if isinstance(tokens, int) and tokens > 0:
        return tokens
    return DEFAULT_CACHE_TOKENS


def _node_id() -> str:
    """The Ray node this replica runs on (where its placement group put it); "" outside Ray."""
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except Exception:  # pragma: no cover - a Ray worker without a node id
        pass
    return ""


def _replica_id() -> str:
    """Serve's id of this replica (a stand-in outside Serve, e.g. in unit tests)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not inside a Serve replica
        return f"local-{id(object())}"


# The prefix_cache policy's replica side ----------------------------------------------------
# What this replica's prefix cache holds, as the block hashes of what it served. The router
# hashes each request's leading blocks once (serve_app/routing/prefix_blocks.py) and sends the
# hashes with it; the replica records them as it hands the request to the engine (which caches
# the prompt as it prefills it: requests sharing a prefix that arrive meanwhile are sent here). The record is bounded: the engine's KV cache in blocks, evicted least
# recently used first. That approximates vLLM's eviction (free blocks go least recently used
# first, a request's tail blocks before its head): a request's hashes are touched last block
# first, so its first block is the most recent and a prefix outlives its tails, as in the
# engine. It does not see the blocks running requests pin, nor the engine's own block edges
# (docs/routing.md). Every router reads the same record through its engine feed
# (ServedBlocks.report): the changes since the state it says it holds (a change count within
# the record's epoch), or the whole record when it holds none or is further behind than the
# change log keeps; every router's index (serve_app/routing/prefix_index.py) converges on it.

@dataclasses.dataclass
class RecordError:
    """The LRU approximation's error, over the requests whose engine reports its cached prompt
    tokens (vLLM): the tokens the record predicted cached when the request came (its leading
    blocks held, in the router's blocks) against the engine's count on the first chunk."""

    requests: int = 0
    prompt_tokens: int = 0
    predicted_tokens: int = 0
    cached_tokens: int = 0
    abs_error_tokens: int = 0
    over_tokens: int = 0  # predicted but not cached (evicted, or not yet prefilled)

    def add(self, predicted: int, cached: float | None, prompt_tokens: int) -> None:
        if cached is None:
            return
        predicted = min(predicted, prompt_tokens)
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.predicted_tokens += predicted
        self.cached_tokens += int(cached)
        self.abs_error_tokens += abs(predicted - int(cached))
        self.over_tokens += max(0, predicted - int(cached))

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in dataclasses.asdict(self).items()}


# Changes kept for routers that are behind, as a multiple of the capacity; a router further
# behind gets the whole record.
LOG_FACTOR = 2


class ServedBlocks:
    """An LRU set of block hashes with a change log (see the comment above)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self.epoch = uuid.uuid4().hex
        self.seq = 0  # changes so far (each add or eviction is one)
        self._held: OrderedDict[int, None] = OrderedDict()
        # (hash, added) for changes seq - len(log) + 1 .. seq.
        self._log: deque[tuple[int, bool]] = deque(maxlen=LOG_FACTOR * capacity)

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, h: int) -> bool:
        return h in self._held

    def record(self, hashes: tuple[int, ...]) -> None:
        """The engine holds ``hashes`` (a request's blocks, first block first): each becomes
        the most recent, the first block last; the least recent beyond ``capacity`` go."""
        held, log = self._held, self._log
        for h in reversed(hashes):
            if h in held:
                held.move_to_end(h)
                continue
            held[h] = None
            log.append((h, True))
            self.seq += 1
        while len(held) > self.capacity:
            h, _ = held.popitem(last=False)
            log.append((h, False))
            self.seq += 1

    def report(self, known: tuple[str, int] | None) -> PrefixReport:
        """The changes since ``known`` = (epoch, seq) a router holds, or the whole record when
        it holds another epoch, nothing, or a state older than the log reaches."""
        if known is not None and known[0] == self.epoch and \
                self.seq - len(self._log) <= known[1] <= self.seq:
            last: dict[int, bool] = {}  # each hash's last change, newest read first
            log = self._log
            for i in range(1, self.seq - known[1] + 1):
                h, added = log[-i]
                if h not in last:
                    last[h] = added
            return PrefixReport(self.epoch, self.seq, known[1],
                                tuple(h for h, a in last.items() if a),
                                tuple(h for h, a in last.items() if not a))
        return PrefixReport(self.epoch, self.seq, None, tuple(self._held))
