"""The engine the stack builds gets the same defaults as `vllm serve`, and a Ray-executor engine
gets its replica's placement group (no GPU or model needed)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from serve_app.config import ModelSettings
from serve_app.engine import vllm_adapter
from serve_app.engine.vllm_adapter import VLLMEngine, engine_args_for


class _Captured(Exception):
    pass


def test_engine_uses_vllm_serve_usage_context_regression_batch_budget(monkeypatch):
    """Regression: AsyncLLM.from_engine_args defaults to the ENGINE_CONTEXT usage context,
    which gives an H200 a 2,048-token step budget where `vllm serve` (OPENAI_API_SERVER) gets
    8,192; the stack then prefilled a quarter as many prompts per step as bare vLLM."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    seen = {}

    def fake_create_engine_config(self, usage_context=None):
        seen.update(args=self, usage_context=usage_context)
        raise _Captured

    monkeypatch.setattr(AsyncEngineArgs, "create_engine_config", fake_create_engine_config)
    engine = VLLMEngine(ModelSettings(name="m", path="/nonexistent", device="cpu"))
    with pytest.raises(_Captured):
        asyncio.run(engine.start())
    assert seen["usage_context"] == UsageContext.OPENAI_API_SERVER
    assert seen["args"].scheduling_policy == "priority"


def _start_capturing_config(monkeypatch, settings: ModelSettings) -> SimpleNamespace:
    """Run VLLMEngine.start up to AsyncLLM's construction; return the VllmConfig it got."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    config = SimpleNamespace(parallel_config=SimpleNamespace(placement_group=None))
    seen = {}
    monkeypatch.setattr(AsyncEngineArgs, "create_engine_config", lambda self, usage: config)

    def fake_from_vllm_config(vllm_config, **kwargs):
        seen["config"] = vllm_config
        raise _Captured

    monkeypatch.setattr(AsyncLLM, "from_vllm_config", staticmethod(fake_from_vllm_config))
    with pytest.raises(_Captured):
        asyncio.run(VLLMEngine(settings).start())
    return seen["config"]


def test_ray_executor_engine_gets_the_replicas_placement_group(monkeypatch):
    group = object()
    asked = []
    monkeypatch.setattr(vllm_adapter, "replica_placement_group",
                        lambda tp: asked.append(tp) or group)
    settings = ModelSettings(name="m", path="/m", tensor_parallel_size=2,
                             pipeline_parallel_size=2)
    config = _start_capturing_config(monkeypatch, settings)
    assert config.parallel_config.placement_group is group
    assert asked == [2]


def test_engine_without_ray_executor_reserves_nothing(monkeypatch):
    monkeypatch.setattr(vllm_adapter, "replica_placement_group",
                        lambda tp: pytest.fail("only the Ray executor takes a placement group"))
    for settings in (ModelSettings(name="m", path="/m"),
                     ModelSettings(name="m", path="/m", tensor_parallel_size=2,
                                   distributed_executor_backend="mp")):
        config = _start_capturing_config(monkeypatch, settings)
        assert config.parallel_config.placement_group is None


@pytest.mark.parametrize("kw, backend", [
    ({}, None),
    ({"tensor_parallel_size": 2}, "ray"),
    ({"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}, "mp"),
    ({"distributed_executor_backend": "ray"}, "ray"),
    ({"device": "cpu", "tensor_parallel_size": 2}, "mp"),
])
def test_executor_backend_reaches_engine_args(kw, backend):
    args = engine_args_for(ModelSettings(name="m", path="/m", **kw))
    assert args.get("distributed_executor_backend") == backend


def test_prefill_average_leaves_prefix_cache_hits_out_regression_cached_prompts_throttled():
    """Regression (H200, 1,024-token prompts seen before): the recent prompt length counted
    tokens the prefix cache held, so admission let 2 prompts per step reach an engine that
    could start dozens; the stack ran fewer requests than bare vLLM (0.93x throughput)."""
    engine = VLLMEngine(ModelSettings(name="m", path="/nonexistent", device="cpu"))
    engine._prefill_tokens_avg = 1024.0
    for _ in range(5):
        engine._note_prefill(1024, None)  # no cache information: the whole prompt
    assert engine.load().prefill_tokens_avg == pytest.approx(1024.0)
    for _ in range(40):
        engine._note_prefill(1024, 1008)  # 63 of 64 blocks cached
    assert engine.load().prefill_tokens_avg < 40
    engine._note_prefill(1024, 1024)  # a full hit still computes the last token
    assert engine.load().prefill_tokens_avg > 1


def test_the_stat_logger_copies_the_scheduler_counts_each_step():
    """The engine's load (what admission and autoscaling read) comes from vLLM's per-step
    stats through the logger of serve_app/engine/vllm_stats.py, under either name vLLM has
    given the KV-cache use."""
    from serve_app.engine.vllm_stats import SchedulerCounts, stat_logger_factory

    counts = SchedulerCounts()
    step_logger = stat_logger_factory(counts)(None)
    step_logger.record(SimpleNamespace(num_running_reqs=3, num_waiting_reqs=2,
                                       kv_cache_usage=0.5), None)
    assert (counts.running, counts.waiting, counts.kv_cache_usage) == (3, 2, 0.5)
    step_logger.record(SimpleNamespace(num_running_reqs=1, num_waiting_reqs=0,
                                       gpu_cache_usage=0.25), None)
    assert (counts.running, counts.waiting, counts.kv_cache_usage) == (1, 0, 0.25)
    step_logger.record(None, None)  # a step without scheduler stats changes nothing
    assert counts.running == 1


def test_kv_cache_tokens_reads_vllms_cache_config():
    """The prefix_cache record is sized from the adapter's ``kv_cache_tokens`` (the one place
    that reads vLLM's config): its capacity figure, else blocks x block size; None before the
    engine starts."""
    from types import SimpleNamespace

    from serve_app.config import ModelSettings
    from serve_app.engine.vllm_adapter import VLLMEngine

    engine = VLLMEngine(ModelSettings(name="m", path="/nonexistent", device="cpu"))
    assert engine.kv_cache_tokens is None
    cache = SimpleNamespace(num_gpu_blocks=1000, block_size=16)
    engine._engine = SimpleNamespace(vllm_config=SimpleNamespace(cache_config=cache))
    assert engine.kv_cache_tokens == 16_000
    cache.kv_cache_size_tokens = 15_872
    assert engine.kv_cache_tokens == 15_872
