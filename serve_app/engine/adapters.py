"""The LoRA adapters one engine has been given, and the one rule for giving it one.

An engine learns of an adapter from a request (:attr:`GenerationRequest.adapter`: name, id,
path, from the router's live adapter table): it holds no adapter list of its own, so adding
or removing an adapter changes no engine argument and restarts no replica. The first request
for an adapter loads it explicitly (vLLM's ``add_lora``) before the request is submitted: a
folder that fails to load fails that request with 503, naming the adapter, and nothing else
(a load failing inside an engine step would fail the step, every request in it). After that
vLLM keeps it in its host-memory cache (``max_cpu_loras``) and swaps it into one of its
``max_loras`` batch slots when a request needs it, least recently used out; an adapter it
dropped from host memory is read from its path again by vLLM itself.

The record here mirrors vLLM's host-memory LRU by use: what the replica reports as loaded
(:attr:`EngineLoad.adapters`), for routing and ``serve-app status``. Pure (no vLLM import):
the vLLM adapter passes its loading call in.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Awaitable, Callable

from serve_app.engine.protocol import EngineRequestError

AdapterRef = tuple[str, int, str]  # (name, id, path), as GenerationRequest.adapter carries it
LoadAdapter = Callable[[str, int, str], Awaitable[Any]]
# Told of each swap: ("load" | "evict", adapter name). Must return at once and never raise.
OnSwap = Callable[[str, str], None]


class LoadedAdapters:
    """Adapters an engine holds, least recently used first (capacity: its ``max_cpu_loras``;
    0: LoRA is off in this engine). Single-threaded (the replica's event loop)."""

    def __init__(self, model: str, capacity: int) -> None:
        self.model = model
        self.capacity = capacity
        self.loads = 0  # adapters loaded since the engine started (a swap into host memory)
        self.evictions = 0  # adapters dropped, least recently used, to make room
        # Set by the replica (LLMServer) to count swaps in its metric; None: not counted.
        self.on_swap: OnSwap | None = None
        self._held: OrderedDict[int, str] = OrderedDict()

    async def ensure(self, adapter: AdapterRef, load: LoadAdapter) -> None:
        """Make ``adapter`` usable by the next request: loaded through ``load`` unless held.
        Raises :class:`EngineRequestError` (503, code ``adapter_unavailable``) when LoRA is
        off here or the load fails; the adapter is then not held, so a later request tries
        again (a folder fixed in place needs no restart)."""
        name, adapter_id, _ = adapter
        if self.capacity <= 0:
            raise EngineRequestError(
                f"The adapter `{name}` cannot be served: LoRA is off in the engines of "
                f"{self.model} (the model needs `lora:` in the config).", status_code=503,
                param="model", code="adapter_unavailable")
        if adapter_id in self._held:
            self._held.move_to_end(adapter_id)
            return
        try:
            ok = await load(*adapter)
        except Exception as err:  # vLLM's loader raises what the folder's reader raised
            raise EngineRequestError(
                f"The adapter `{name}` could not be loaded: {type(err).__name__}: {err}",
                status_code=503, param="model", code="adapter_unavailable") from None
        if ok is False:
            raise EngineRequestError(f"The adapter `{name}` could not be loaded.",
                                     status_code=503, param="model", code="adapter_unavailable")
        self.loads += 1
        self._held[adapter_id] = name
        self._swapped("load", name)
        while len(self._held) > self.capacity:
            _, dropped = self._held.popitem(last=False)
            self.evictions += 1
            self._swapped("evict", dropped)

    def _swapped(self, event: str, name: str) -> None:
        if self.on_swap is not None:
            try:
                self.on_swap(event, name)
            except Exception:  # a metric must never fail a request
                pass

    def names(self) -> tuple[str, ...]:
        """Held adapters' names, least recently used first."""
        return tuple(self._held.values())
