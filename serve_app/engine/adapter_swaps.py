"""The LLMServer's adapter-swap metric (``ray_serve_app_adapter_swaps_total``, by model,
adapter and event): the engine's :class:`~serve_app.engine.adapters.LoadedAdapters` tells it
of each load and eviction (its ``on_swap``). Registered on the first swap, so a replica
without LoRA registers nothing.

The name comes from the metric table (``ROUTER_METRICS["adapter_swaps"]``) through the
deployment's arguments (serve_app/app.py), not by import: the engine replica's code digest
leaves the table out (its help texts must not restart engines), so the help text is the
table's alone and Ray's is a pointer to it.
"""

from __future__ import annotations

from typing import Any


class AdapterSwapCounter:
    """Counts one model's adapter swaps under the registered name ``name``; ``record`` is an
    :data:`~serve_app.engine.adapters.OnSwap` callback."""

    def __init__(self, name: str, model: str) -> None:
        self.name = name
        self.model = model
        self._counter: Any = None

    def record(self, event: str, adapter: str) -> None:
        if self._counter is None:
            from ray.serve.metrics import Counter

            self._counter = Counter(self.name, description="LoRA adapter loads and evictions "
                                    "(serve_app/observability/metrics.py)",
                                    tag_keys=("model", "adapter", "event"))
        self._counter.inc(1, tags={"model": self.model, "adapter": adapter, "event": event})


def count_swaps(engine: object, name: str, model: str) -> AdapterSwapCounter | None:
    """Hook a counter named ``name`` to ``engine``'s adapter record (its ``loras``, where it
    has one: the vLLM and scripted engines); None when it has none or ``name`` is empty."""
    loras = getattr(engine, "loras", None)
    if not name or loras is None or not hasattr(loras, "on_swap"):
        return None
    counter = AdapterSwapCounter(name, model)
    loras.on_swap = counter.record
    return counter
