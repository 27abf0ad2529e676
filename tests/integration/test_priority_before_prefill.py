"""The model's ``priority_before_prefill`` on the real vLLM CPU engine: the engine core runs
serve_app/engine/vllm_scheduler.py, and a quiet tenant's request that arrives while four flood
prompts are part-way through their chunked prefill gets its first token before any of them.
Without it vLLM serves the running prefills first (tests/unit/test_vllm_scheduler.py shows that
on vLLM's own scheduler), so the quiet request's first token would come after theirs.

Asserted on order, not wall time: a 16-token step budget makes a 1,900-token flood prompt take
119 steps, and the quiet request is sent once the engine reports the floods in it (the first
mid-prefill, the rest waiting: vLLM starts no waiting request while a running prefill takes
the whole budget)."""

from __future__ import annotations

import asyncio
import time
import pytest

from serve_app.config import ModelSettings
from serve_app.engine.priority import encode_priority
from serve_app.engine.protocol import GenerationRequest, SamplingOptions
from serve_app.engine.vllm_adapter import VLLMEngine

pytestmark = [pytest.mark.integration, pytest.mark.long]  # one engine start on 2 cores, ~1.5 min

FLOODS, FLOOD_PROMPT, QUIET_PROMPT, BUDGET = 4, 1900, 12, 16


def _request(request_id: str, prompt_tokens: int, priority: int) -> GenerationRequest:
    return GenerationRequest(request_id=request_id, prompt_token_ids=[5] * prompt_tokens,
                             sampling=SamplingOptions(max_tokens=2, ignore_eos=True),
                             priority=priority)


async def _first_token_at(engine: VLLMEngine, request: GenerationRequest,
                          firsts: dict[str, float]) -> None:
    async for _ in engine.generate(request):
        firsts.setdefault(request.request_id, time.monotonic())


def test_a_quiet_request_beside_flood_prefills_gets_its_first_token_first(tiny_model_path):
    async def scenario() -> dict[str, float]:
        engine = VLLMEngine(ModelSettings(
            name="tiny", path=str(tiny_model_path), device="cpu", max_model_len=2048,
            priority_before_prefill=True,
            engine_kwargs={"dtype": "float32", "enforce_eager": True, "max_num_seqs": 16,
                           "max_num_batched_tokens": BUDGET,
                           # A 1 GiB KV cache, as the CPU config's VLLM_CPU_KVCACHE_SPACE gives
                           # its replicas: without it vLLM's CPU engine asks for 92% of the
                           # machine's memory and refuses to start beside the rest of the
                           # suite (seen in a full `make test-long`).
                           "kv_cache_memory_bytes": 1 << 30}))
        await engine.start()
        try:
            scheduler = engine._engine.vllm_config.scheduler_config.scheduler_cls
            assert scheduler.__name__ == "PriorityBeforePrefillScheduler"  # CPU: async off
            firsts: dict[str, float] = {}
            floods = [asyncio.create_task(_first_token_at(
                engine, _request(f"flood-{i}", FLOOD_PROMPT, encode_priority(1, 100 + i)),
                firsts)) for i in range(FLOODS)]
            deadline = time.monotonic() + 60
            while (load := engine.load()).running + load.waiting < FLOODS:
                assert time.monotonic() < deadline, load
                assert not firsts, "a flood prompt finished its prefill before the quiet request"
                await asyncio.sleep(0.005)
            await _first_token_at(engine, _request("quiet", QUIET_PROMPT,
                                                   encode_priority(1, 0)), firsts)
            await asyncio.gather(*floods)
            return firsts
        finally:
            await engine.shutdown()

    firsts = asyncio.run(scenario())
    floods = [firsts[f"flood-{i}"] for i in range(FLOODS)]
    assert firsts["quiet"] < min(floods), firsts
