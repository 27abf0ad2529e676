"""Prompt tokenization in the vLLM adapter: long texts are encoded off the replica's event loop,
and a text that cannot fit the context is refused before anything is encoded."""

from __future__ import annotations

import asyncio
import threading

import pytest

from serve_app.config import ModelSettings
from serve_app.engine import vllm_adapter
from serve_app.engine.protocol import EngineRequestError, GenerationRequest, SamplingOptions
from serve_app.engine.vllm_adapter import INLINE_TOKENIZE_CHARS, VLLMEngine
from serve_app.models import write_tokenizer


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> VLLMEngine:
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer(folder, 1024)
    e = VLLMEngine(ModelSettings(name="m", path=str(folder), device="cpu"))
    e._tokenizer = AutoTokenizer.from_pretrained(folder)
    e._max_model_len = 2048
    e._max_token_chars = vllm_adapter._longest_token_chars(e._tokenizer)
    return e


def _request(prompt: str | None = None, messages: list | None = None) -> GenerationRequest:
    return GenerationRequest(request_id="r", sampling=SamplingOptions(max_tokens=4),
                             prompt=prompt, messages=messages)


def test_longest_token_bounds_the_token_count(engine):
    text = "hello world, " * 50
    ids = engine._prompt_ids(_request(text))
    assert engine._max_token_chars > 1
    assert len(ids) >= len(text) / engine._max_token_chars


@pytest.mark.parametrize("kind", ["prompt", "messages"])
def test_oversized_text_refused_before_encoding(engine, monkeypatch, kind):
    chars = engine._max_token_chars * engine._max_model_len  # at least max_model_len tokens
    text = "x" * chars
    monkeypatch.setattr(engine, "_prompt_ids", lambda r: pytest.fail("encoded anyway"))
    req = _request(text) if kind == "prompt" else _request(
        messages=[{"role": "user", "content": text}])
    with pytest.raises(EngineRequestError) as info:
        asyncio.run(engine._prompt_ids_off_loop(req))
    assert info.value.code == "context_length_exceeded" and info.value.param == kind


def test_long_prompt_encoded_off_the_event_loop(engine, monkeypatch):
    seen = []
    real = VLLMEngine._prompt_ids

    def recording(req):
        seen.append(threading.current_thread() is threading.main_thread())
        return real(engine, req)

    monkeypatch.setattr(engine, "_prompt_ids", recording)
    short = asyncio.run(engine._prompt_ids_off_loop(_request("hi")))
    long = asyncio.run(engine._prompt_ids_off_loop(_request("y" * INLINE_TOKENIZE_CHARS)))
    assert seen == [True, False]  # short inline, long on a worker thread
    assert len(short) >= 2 and len(long) >= INLINE_TOKENIZE_CHARS / engine._max_token_chars
