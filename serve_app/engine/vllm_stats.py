"""What the vLLM engine reports each step, as the adapter (:mod:`.vllm_adapter`) uses it.

vLLM calls its stat loggers once per engine step (with its stats on). :func:`stat_logger_factory`
gives it one that copies the scheduler's running and waiting counts and the KV-cache use into a
:class:`SchedulerCounts` (the replica's :class:`~serve_app.engine.protocol.EngineLoad`) and
ticks the replica's stall watch, whose step clock it is; :func:`ray_metrics_loggers` adds vLLM's
own metrics, exported through Ray. vllm is imported inside the functions that need it (this
module and the adapter are the only ones of the project that import it).
"""

from __future__ import annotations

import time
from typing import Any

from serve_app.engine.stall import StallWatch


class SchedulerCounts:
    """Latest running/waiting counts reported by the engine's scheduler, and the stall watch
    its steps feed (off until :meth:`.vllm_adapter.VLLMEngine.start` sets its timeout)."""

    __slots__ = ("running", "waiting", "kv_cache_usage", "watch")

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_cache_usage = 0.0
        self.watch = StallWatch(None)


def stat_logger_factory(counts: SchedulerCounts) -> Any:
    """A vLLM StatLogger class that copies scheduler counts into ``counts`` each step."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _CountsLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any,
                   **kwargs: Any) -> None:
            if scheduler_stats is not None:
                counts.running = scheduler_stats.num_running_reqs
                counts.waiting = scheduler_stats.num_waiting_reqs
                counts.watch.stepped(time.monotonic(), counts.running + counts.waiting > 0)
                # `gpu_cache_usage` before vLLM renamed it (same meaning on CPU builds).
                counts.kv_cache_usage = float(getattr(scheduler_stats, "kv_cache_usage", None)
                                              or getattr(scheduler_stats, "gpu_cache_usage", 0.0))

        def log_engine_initialized(self) -> None:
            pass

    return _CountsLogger


def ray_metrics_loggers() -> list[Any]:
    """vLLM's own engine metrics, exported through Ray's metrics agent when inside Ray.

    They appear on the node's metrics endpoint as ``ray_vllm_*`` (``:`` becomes ``_``)."""
    try:
        import ray

        if not ray.is_initialized():
            return []
        from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger
    except ImportError:
        return []
    return [RayPrometheusStatLogger]
