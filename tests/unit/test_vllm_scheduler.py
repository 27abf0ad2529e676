"""serve_app/engine/vllm_scheduler.py against the installed vLLM's real scheduler (no engine, no
model run): a quiet tenant's request starts before a flood's partial prefill, decodes are never
held, alike tenants do not hold each other, and vLLM's own order is what the module changes
(if vLLM changes it, the first test says so)."""

from __future__ import annotations

import time

import pytest

from serve_app.engine.priority import encode_priority, outranks
from serve_app.models import write_tiny_model

BUDGET = 64  # tokens per step: a 200-token prompt takes four steps
QUIET, FLOOD, FLOOD_ALIKE = encode_priority(1, 0), encode_priority(1, 200), encode_priority(1, 198)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("sched") / "tiny")


def _scheduler(cls, model_dir, max_num_seqs: int = 16):
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), max_model_len=1024),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=BUDGET, max_model_len=1024,
            enable_chunked_prefill=True, policy="priority", is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=16, enable_prefix_caching=False))
    config.cache_config.num_gpu_blocks = 400
    kv = KVCacheConfig(num_blocks=400, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["layer"], FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=16,
                                     dtype=torch.float32))])
    return cls(vllm_config=config, kv_cache_config=kv, block_size=16, log_stats=False,
               structured_output_manager=StructuredOutputManager(config))


def _request(request_id: str, prompt_tokens: int, priority: int):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(request_id=request_id, prompt_token_ids=list(range(1, prompt_tokens + 1)),
                   sampling_params=SamplingParams(max_tokens=4), pooling_params=None,
                   arrival_time=time.time(), priority=priority)


def _vllms():
    from vllm.v1.core.sched.scheduler import Scheduler
    return Scheduler


def _ours():
    from serve_app.engine.vllm_scheduler import PriorityBeforePrefillScheduler
    return PriorityBeforePrefillScheduler


def _flood_mid_prefill_then_quiet(cls, model_dir, quiet_priority: int = QUIET):
    scheduler = _scheduler(cls, model_dir)
    scheduler.add_request(_request("flood", 200, FLOOD))
    assert scheduler.schedule().num_scheduled_tokens == {"flood": BUDGET}  # chunk 1 of 4
    scheduler.add_request(_request("quiet", 40, quiet_priority))
    return scheduler


def test_vllm_serves_a_floods_partial_prefill_before_a_better_priority_waiting(model_dir):
    """Why the module exists: vLLM's scheduler gives the step to the running partial prefill
    first, so the waiting request of the better priority gets nothing this step."""
    scheduler = _flood_mid_prefill_then_quiet(_vllms(), model_dir)
    assert scheduler.schedule().num_scheduled_tokens == {"flood": BUDGET}


def test_a_quiet_request_starts_before_a_floods_partial_prefill_regression_42d(model_dir):
    scheduler = _flood_mid_prefill_then_quiet(_ours(), model_dir)
    assert scheduler.schedule().num_scheduled_tokens == {"quiet": 40}  # all of it, this step
    # The held prefill is back in its place (first) and goes on at the next step.
    assert [r.request_id for r in scheduler.running] == ["flood", "quiet"]
    scheduler.requests["quiet"].append_output_token_ids(7)  # the quiet request's first token
    assert scheduler.schedule().num_scheduled_tokens == {"flood": BUDGET}


def test_the_held_prefill_resumes_with_its_blocks_and_finishes_its_prompt(model_dir):
    scheduler = _flood_mid_prefill_then_quiet(_ours(), model_dir)
    flood = scheduler.requests["flood"]
    blocks = len(scheduler.kv_cache_manager.get_block_ids("flood")[0])
    scheduler.schedule()  # the quiet prompt's step: the flood held
    assert flood.num_computed_tokens == BUDGET
    assert len(scheduler.kv_cache_manager.get_block_ids("flood")[0]) == blocks
    for _ in range(4):
        scheduler.schedule()
    assert flood.num_computed_tokens == 200  # the whole prompt, nothing recomputed


def test_alike_flooding_tenants_do_not_hold_each_others_prefill(model_dir):
    scheduler = _flood_mid_prefill_then_quiet(_ours(), model_dir, quiet_priority=FLOOD_ALIKE)
    assert scheduler.schedule().num_scheduled_tokens == {"flood": BUDGET}


def test_decodes_are_never_held(model_dir):
    scheduler = _scheduler(_ours(), model_dir)
    scheduler.add_request(_request("flood", 30, FLOOD))
    assert scheduler.schedule().num_scheduled_tokens == {"flood": 30}  # prefilled in one
    scheduler.requests["flood"].append_output_token_ids(7)  # its first token: now decoding
    scheduler.add_request(_request("quiet", 40, QUIET))
    step = scheduler.schedule().num_scheduled_tokens
    assert step == {"flood": 1, "quiet": 40}  # the flood's decode runs beside the quiet prompt


def test_holding_admits_no_more_than_max_num_seqs(model_dir):
    scheduler = _scheduler(_ours(), model_dir, max_num_seqs=2)
    scheduler.add_request(_request("flood", 200, FLOOD))
    scheduler.schedule()
    for name in ("quiet", "quiet2"):
        scheduler.add_request(_request(name, 8, QUIET))
    step = scheduler.schedule().num_scheduled_tokens
    assert set(step) == {"quiet"}  # one slot was free: the held flood keeps its own
    assert len(scheduler.running) == 2


def test_the_variant_follows_the_engines_async_scheduling():
    from types import SimpleNamespace

    from serve_app.engine.vllm_scheduler import (AsyncPriorityBeforePrefillScheduler,
                                                 PriorityBeforePrefillScheduler,
                                                 use_priority_before_prefill)
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    for on, cls in ((True, AsyncPriorityBeforePrefillScheduler),
                    (False, PriorityBeforePrefillScheduler)):
        config = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=on,
                                                                  scheduler_cls=None))
        use_priority_before_prefill(config)
        assert config.scheduler_config.scheduler_cls is cls
    assert issubclass(AsyncPriorityBeforePrefillScheduler, AsyncScheduler)


@pytest.mark.parametrize("waiting, running, expected", [
    (QUIET, FLOOD, True),
    (FLOOD_ALIKE, FLOOD, False),  # alike tenants
    (encode_priority(1, 99), encode_priority(1, 200), True),  # fewer than half
    (encode_priority(1, 100), encode_priority(1, 200), False),
    (encode_priority(0, 500), encode_priority(1, 0), True),  # a better band
    (encode_priority(1, 0), encode_priority(0, 500), False),
    (0, 0, False),  # bare vLLM: every request alike
])
def test_outranks(waiting, running, expected):
    assert outranks(waiting, running) is expected
