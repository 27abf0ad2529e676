"""The scripted engine keeps the scheduling contract the router relies on (no Ray, no model)."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.config import ModelSettings
from serve_app.engine.protocol import Engine, EngineRequestError, GenerationRequest, SamplingOptions
from serve_app.engine.scripted import ScriptedEngine


def _engine(batch: int = 1) -> ScriptedEngine:
    return ScriptedEngine(ModelSettings(name="s", path="./unused", device="cpu",
                                        max_model_len=64, engine_kwargs={
                                            "max_num_seqs": batch, "scripted_step_s": 0.001}))


def _request(rid: str, tokens: int = 3, priority: int = 0, stream: bool = True,
             n: int = 1) -> GenerationRequest:
    return GenerationRequest(request_id=rid, sampling=SamplingOptions(max_tokens=tokens, n=n),
                             prompt="a b c", priority=priority, stream=stream)


async def _drain(engine: ScriptedEngine, request: GenerationRequest) -> list:
    return [chunk async for chunk in engine.generate(request)]


async def test_streams_one_token_per_step_and_finishes_with_length():
    engine = _engine()
    await engine.start()
    assert isinstance(engine, Engine)
    chunks = await _drain(engine, _request("r", tokens=3, n=2))
    assert [c.deltas[0].text for c in chunks] == [" t0", " t1", " t2"]
    assert chunks[-1].finished and chunks[-1].deltas[1].finish_reason == "length"
    assert all(c.prompt_tokens == 3 for c in chunks)
    final = await _drain(engine, _request("f", tokens=3, stream=False))
    assert len(final) == 1 and final[0].deltas[0].text == " t0 t1 t2"
    assert final[0].deltas[0].num_tokens == 3
    await engine.shutdown()


async def test_waiting_requests_start_by_priority_then_arrival_within_the_batch_limit():
    engine = _engine(batch=1)
    await engine.start()
    tasks = [asyncio.create_task(_drain(engine, _request(rid, priority=p)))
             for rid, p in [("first", 5), ("low", 9), ("normal-1", 5), ("high", 0),
                            ("normal-2", 5)]]
    await asyncio.sleep(0)  # all arrive before the first step
    assert engine.load().waiting == 5
    await asyncio.gather(*tasks)
    assert engine.started_order() == ["high", "first", "normal-1", "normal-2", "low"]
    assert engine.load().running == 0 and engine.unfinished_requests() == 0
    await engine.shutdown()


async def test_cancelled_request_leaves_the_engine():
    engine = _engine(batch=1)
    await engine.start()
    long = asyncio.create_task(_drain(engine, _request("long", tokens=10_000 // 200)))
    queued = asyncio.create_task(_drain(engine, _request("queued")))
    await asyncio.sleep(0.01)
    assert engine.load().running == 1 and engine.load().waiting == 1
    queued.cancel()
    long.cancel()
    await asyncio.gather(long, queued, return_exceptions=True)
    assert engine.unfinished_requests() == 0
    await engine.shutdown()


async def test_context_overflow_is_a_request_error_before_any_chunk():
    engine = _engine()
    await engine.start()
    with pytest.raises(EngineRequestError) as err:
        await _drain(engine, _request("big", tokens=100))
    assert err.value.param == "max_tokens"
    await engine.shutdown()


async def test_a_held_step_loop_starts_and_emits_nothing_until_released():
    engine = _engine(batch=1)
    await engine.start()
    await asyncio.wait_for(engine.hold_steps(True), 1)  # an idle loop counts as stopped
    first = asyncio.create_task(_drain(engine, _request("first", tokens=2)))
    await asyncio.sleep(0.05)  # 50 steps' time: a loop that ignored the hold would finish
    assert engine.started_order() == [] and not first.done()
    await engine.hold_steps(False)
    assert len(await asyncio.wait_for(first, 1)) == 2
    # Held mid-stream: once hold_steps returns, no token comes until the release.
    chunks: list = []

    async def collect() -> None:
        async for chunk in engine.generate(_request("second", tokens=60)):
            chunks.append(chunk)

    async def first_token() -> None:
        while not chunks:
            await asyncio.sleep(0.001)

    second = asyncio.create_task(collect())
    await asyncio.wait_for(first_token(), 5)
    await asyncio.wait_for(engine.hold_steps(True), 1)
    seen = len(chunks)
    await asyncio.sleep(0.05)  # 50 steps' time
    assert 0 < seen == len(chunks) < 60
    await engine.hold_steps(False)
    await asyncio.wait_for(second, 1)
    assert len(chunks) == 60 and engine.started_order() == ["first", "second"]
    await engine.shutdown()


async def test_it_reports_the_adapters_it_ran_least_recent_first_as_vllm_does():
    from serve_app.config import LoraSettings

    engine = ScriptedEngine(ModelSettings(name="s", path="./unused", device="cpu",
                                          max_model_len=64, lora=LoraSettings(max_loras=2),
                                          engine_kwargs={"scripted_step_s": 0.001}))
    await engine.start()
    for rid, adapter in (("1", "a"), ("2", "b"), ("3", "a"), ("4", "c")):
        request = _request(rid)
        request.adapter = (adapter, ord(adapter), f"/adapters/{adapter}")
        await _drain(engine, request)
    assert engine.load().adapters == ("a", "c")  # b least recent: out of the two places
    await engine.shutdown()
    plain = _engine()
    await plain.start()
    request = _request("x")
    request.adapter = ("a", 1, "/adapters/a")
    with pytest.raises(EngineRequestError, match="LoRA is off"):
        await _drain(plain, request)
    assert plain.load().adapters == ()
    await plain.shutdown()
