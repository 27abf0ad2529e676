"""The engine the stack builds gets the same defaults as `vllm serve` (no GPU or model needed)."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.config import ModelSettings
from serve_app.engine.vllm_adapter import VLLMEngine


class _Captured(Exception):
    pass


def test_engine_uses_vllm_serve_usage_context_regression_batch_budget(monkeypatch):
    """Regression: AsyncLLM.from_engine_args defaults to the ENGINE_CONTEXT usage context,
    which gives an H200 a 2,048-token step budget where `vllm serve` (OPENAI_API_SERVER) gets
    8,192; the stack then prefilled a quarter as many prompts per step as bare vLLM."""
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    seen = {}

    def fake_from_engine_args(args, **kwargs):
        seen.update(kwargs, args=args)
        raise _Captured

    monkeypatch.setattr(AsyncLLM, "from_engine_args", staticmethod(fake_from_engine_args))
    engine = VLLMEngine(ModelSettings(name="m", path="/nonexistent", device="cpu"))
    with pytest.raises(_Captured):
        asyncio.run(engine.start())
    assert seen["usage_context"] == UsageContext.OPENAI_API_SERVER
    assert seen["args"].scheduling_policy == "priority"
