"""OpenAI request validation and the response/SSE formatting, without Ray."""

import json

import pytest

from serve_app.engine.protocol import ChoiceDelta, GenerationChunk
from serve_app.ingress.errors import OpenAIError
from serve_app.ingress.protocol import ChatCompletionRequest, CompletionRequest
from serve_app.ingress.responses import DONE_EVENT, ResponseBuilder
from serve_app.ingress.http import parse_request


def _bad(model_cls, body) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        parse_request(model_cls, body)
    assert info.value.status_code == 400
    return info.value


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x"}, "model"),
        ({"model": "m"}, "prompt"),
        ({"model": "m", "prompt": ""}, "prompt"),
        ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
        ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "prompt": "x", "temperature": 3}, "temperature"),
        ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
        ({"model": "m", "prompt": "x", "n": 0}, "n"),
        ({"model": "m", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"model": "m", "prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ],
)
def test_completion_validation_names_param(body, param):
    assert _bad(CompletionRequest, body).param == param


def test_unsupported_features_refused_not_ignored():
    err = _bad(CompletionRequest, {"model": "m", "prompt": "x", "logprobs": 2})
    assert "logprobs is not supported" in err.message
    err = _bad(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                       "tools": [{"type": "function"}]})
    assert "tools" in err.message


def test_stream_options_need_stream():
    err = _bad(CompletionRequest, {"model": "m", "prompt": "x", "stream_options": {}})
    assert "stream_options" in err.message


def test_chat_validation():
    _bad(ChatCompletionRequest, {"model": "m", "messages": []})
    _bad(ChatCompletionRequest, {"model": "m", "messages": [{"role": "wizard", "content": "x"}]})
    _bad(ChatCompletionRequest, {"model": "m", "messages": "hello"})


def test_body_must_be_object():
    _bad(CompletionRequest, ["model"])


def test_translation_to_engine_request():
    req = parse_request(CompletionRequest, {"model": "m", "prompt": [1, 2, 3], "stop": "x",
                                            "max_tokens": 5, "seed": 7, "ignore_eos": True})
    gen = req.to_generation("r1")
    assert gen.prompt_token_ids == [1, 2, 3] and gen.prompt is None
    assert gen.sampling.stop == ["x"] and gen.sampling.max_tokens == 5
    assert gen.sampling.seed == 7 and gen.sampling.ignore_eos
    chat = parse_request(ChatCompletionRequest, {
        "model": "m", "max_completion_tokens": 9,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}]}]})
    g = chat.to_generation("r2")
    assert g.messages == [{"role": "user", "content": "ab"}] and g.sampling.max_tokens == 9


def _chunks():
    return [
        GenerationChunk([ChoiceDelta(0, "Hel", 1), ChoiceDelta(1, "A", 1)], 4, False),
        GenerationChunk([ChoiceDelta(0, "lo \"q\"", 2, "length")], 4, False),
        GenerationChunk([ChoiceDelta(1, "", 0, "stop", "\n")], 4, True),
    ]


def _parse_sse(raw: bytes) -> list:
    events = [e for e in raw.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in events]


def test_completion_stream_events_are_valid_json_and_count_usage():
    b = ResponseBuilder("completion", "cmpl-1", "m", n=2)
    raw = b"".join(b.events(c) for c in _chunks()) + b.final_events(include_usage=True)
    events = _parse_sse(raw)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
    texts = {0: "", 1: ""}
    for e in events[:-2]:
        assert e["object"] == "text_completion" and e["id"] == "cmpl-1"
        c = e["choices"][0]
        texts[c["index"]] += c["text"]
    assert texts == {0: 'Hello "q"', 1: "A"}


def test_chat_stream_starts_with_role_and_ends_with_finish_reason():
    b = ResponseBuilder("chat", "chatcmpl-1", "m", n=2)
    events = _parse_sse(b"".join(b.events(c) for c in _chunks()) + b.final_events(False))
    assert events[-1] == "[DONE]"
    first = events[0]["choices"][0]
    assert first["delta"] == {"role": "assistant", "content": ""}
    finishes = [e["choices"][0]["finish_reason"] for e in events[:-1]
                if e["choices"][0]["finish_reason"]]
    assert sorted(finishes) == ["length", "stop"]


def test_non_streaming_body():
    b = ResponseBuilder("chat", "chatcmpl-1", "m", n=2)
    for c in _chunks():
        b.add(c)
    body = b.body()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == 'Hello "q"'
    assert body["choices"][1]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 4


def test_done_event_only_without_usage():
    assert ResponseBuilder("completion", "x", "m", 1).final_events(False) == DONE_EVENT
