"""Every bad input gets a 4xx with an OpenAI-style error body, and the service stays healthy."""

import pytest

pytestmark = pytest.mark.integration

M = "tiny-llama"
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"

CASES = [
    # (id, method, path, body or raw bytes, expected status, expected param or None)
    ("unknown-model", "POST", COMP, {"model": "gpt-5", "prompt": "x"}, 404, "model"),
    ("missing-model", "POST", COMP, {"prompt": "x"}, 400, "model"),
    ("missing-prompt", "POST", COMP, {"model": M}, 400, "prompt"),
    ("empty-prompt", "POST", COMP, {"model": M, "prompt": ""}, 400, "prompt"),
    ("negative-max-tokens", "POST", COMP, {"model": M, "prompt": "x", "max_tokens": -5}, 400,
     "max_tokens"),
    ("temperature-too-high", "POST", COMP, {"model": M, "prompt": "x", "temperature": 9}, 400,
     "temperature"),
    ("top-p-zero", "POST", COMP, {"model": M, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("n-too-large", "POST", COMP, {"model": M, "prompt": "x", "n": 1000}, 400, "n"),
    # Regression (router hang found by the schema fuzzer): an `n` of 10**12 was checked only
    # after the response builder had allocated one choice per `n`; the replica ran out of memory.
    ("huge-n-regression-router-hang", "POST", COMP, {"model": M, "prompt": "x", "n": 10**12},
     400, "n"),
    ("chat-huge-n-regression-router-hang", "POST", CHAT,
     {"model": M, "messages": [{"role": "user", "content": "x"}], "n": 10**12}, 400, "n"),
    ("wrong-type", "POST", COMP, {"model": M, "prompt": {"text": "x"}}, 400, "prompt"),
    ("context-too-long", "POST", COMP, {"model": M, "prompt": "x" * 3000, "max_tokens": 4}, 400,
     "prompt"),
    ("max-tokens-past-context", "POST", COMP, {"model": M, "prompt": "x", "max_tokens": 4096}, 400,
     "max_tokens"),
    # Regression (the schema fuzzer): vLLM 0.32's refusal is no longer a ValueError, and the
    # request got a 503 "the model is unavailable right now", every time.
    ("min-tokens-over-max-tokens-regression-503", "POST", COMP,
     {"model": M, "prompt": "x", "min_tokens": 10, "max_tokens": 4}, 400, "min_tokens"),
    ("token-id-out-of-vocab", "POST", COMP, {"model": M, "prompt": [1, 2, 10**9]}, 400, "prompt"),
    ("too-many-stops", "POST", COMP, {"model": M, "prompt": "x", "stop": list("abcdef")}, 400,
     "stop"),
    ("batched-prompts", "POST", COMP, {"model": M, "prompt": ["a", "b"]}, 400, "prompt"),
    ("unsupported-logprobs", "POST", COMP, {"model": M, "prompt": "x", "logprobs": 3}, 400, None),
    ("invalid-json", "POST", COMP, b"{not json", 400, None),
    ("json-array-body", "POST", COMP, b"[1, 2]", 400, None),
    ("empty-body", "POST", COMP, b"", 400, None),
    # Regression: these escaped the JSON reader as plain-text 500s (RecursionError, ValueError).
    ("deeply-nested-json", "POST", COMP, b'{"model": "tiny-llama", "prompt": ' + b"[" * 100_000
     + b"]" * 100_000 + b"}", 400, None),
    ("integer-past-digit-limit", "POST", COMP, b'{"model": "tiny-llama", "prompt": "x", '
     b'"max_tokens": ' + b"9" * 5000 + b"}", 400, None),
    ("oversized-body", "POST", COMP, b'{"model": "tiny-llama", "prompt": "' + b"x" * 1_100_000
     + b'"}', 413, None),
    ("chat-no-messages", "POST", CHAT, {"model": M, "messages": []}, 400, "messages"),
    ("chat-bad-role", "POST", CHAT, {"model": M, "messages": [{"role": "robot", "content": "x"}]},
     400, None),
    ("chat-context-too-long", "POST", CHAT,
     {"model": M, "messages": [{"role": "user", "content": "y" * 3000}]}, 400, "messages"),
    ("stream-options-without-stream", "POST", CHAT,
     {"model": M, "messages": [{"role": "user", "content": "x"}],
      "stream_options": {"include_usage": True}}, 400, None),
    ("unknown-route", "POST", "/v1/embeddings", {"model": M, "input": "x"}, 404, None),
    ("wrong-method", "GET", COMP, None, 405, None),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_openai_4xx_and_service_stays_up(client, case):
    _, method, path, body, status, param = case
    if isinstance(body, bytes):
        r = client.request(method, path, content=body,
                           headers={"Content-Type": "application/json"})
    else:
        r = client.request(method, path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and isinstance(err["message"], str)
    if param is not None:
        assert err["param"] == param, err
    ok = client.post(COMP, json={"model": M, "prompt": "still up?", "max_tokens": 3})
    assert ok.status_code == 200, ok.text


def test_bad_stream_request_fails_before_the_stream_starts(client):
    r = client.post(COMP, json={"model": M, "prompt": "x" * 3000, "stream": True})
    assert r.status_code == 400
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_health(client):
    assert client.get("/health").json() == {"status": "ok"}
