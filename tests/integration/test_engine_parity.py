"""Greedy output through the endpoint equals the engine's own output; usage counts are exact."""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REQUESTS = [
    {"prompt": "The quick brown fox", "max_tokens": 24},
    {"prompt": "Once upon a time, in a land far away,", "max_tokens": 40},
    {"messages": [{"role": "user", "content": "Hello, who are you?"}], "max_tokens": 32},
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Name three colours."}], "max_tokens": 16},
]


# vLLM's own run, started as the session starts (start_early) so that its ~40 s engine start
# overlaps the stack's; the reference fixture collects it.
_EARLY: dict[str, tuple[subprocess.Popen, Path]] = {}


def _start_reference(model_path: Path, out_dir: Path) -> tuple[subprocess.Popen, Path]:
    """Start reference_generate.py on REQUESTS (no Ray, no HTTP); it writes
    ``out_dir/outputs.json``, its logs go to ``out_dir/stderr.log``."""
    spec = out_dir / "requests.json"
    spec.write_text(json.dumps(REQUESTS))
    with spec.open() as stdin, (out_dir / "stderr.log").open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("reference_generate.py")),
             str(model_path), str(out_dir / "outputs.json")],
            stdin=stdin, stdout=subprocess.DEVNULL, stderr=stderr,
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    return proc, out_dir


def start_early(config: pytest.Config) -> None:
    """Called by the integration conftest when the session starts with this module's tests
    selected: vLLM's reference run begins while the stack starts, not after it."""
    from serve_app.models import write_model

    from .conftest import TINY

    out_dir = Path(tempfile.mkdtemp(prefix="parity-reference-"))
    proc, _ = _EARLY["run"] = _start_reference(write_model("tiny", TINY), out_dir)

    def cleanup() -> None:  # a session that never reached the parity tests (-x, ^C)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(out_dir, ignore_errors=True)

    config.add_cleanup(cleanup)


@pytest.fixture(scope="module")
def reference(stack, tmp_path_factory):
    """vLLM's own greedy output for REQUESTS on the stack's model."""
    proc, out_dir = _EARLY.pop("run", None) or _start_reference(
        stack["path"], tmp_path_factory.mktemp("reference"))
    try:
        rc = proc.wait(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert rc == 0, (out_dir / "stderr.log").read_text()[-3000:]
    return json.loads((out_dir / "outputs.json").read_text())


def _ask(client, model, req, stream):
    if "messages" in req:
        body = {"model": model, "messages": req["messages"], "max_tokens": req["max_tokens"],
                "temperature": 0}
        path = "/v1/chat/completions"
    else:
        body = {"model": model, "prompt": req["prompt"], "max_tokens": req["max_tokens"],
                "temperature": 0}
        path = "/v1/completions"
    if not stream:
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        choice = data["choices"][0]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        return text, data["usage"]
    body.update(stream=True, stream_options={"include_usage": True})
    text, usage = "", None
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            for c in event["choices"]:
                text += c.get("text") or (c.get("delta") or {}).get("content") or ""
    return text, usage


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_greedy_output_equals_engine_output(stack, client, reference, stream):
    for req, ref in zip(REQUESTS, reference):
        text, usage = _ask(client, stack["model"], req, stream)
        assert text == ref["text"], req
        assert usage == {"prompt_tokens": ref["prompt_tokens"],
                         "completion_tokens": ref["completion_tokens"],
                         "total_tokens": ref["prompt_tokens"] + ref["completion_tokens"]}


def test_usage_exact_with_ignore_eos_and_n(client, stack):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(stack["path"] / "tokenizer.json"))
    prompt = "count these tokens exactly"
    r = client.post("/v1/completions", json={"model": stack["model"], "prompt": prompt,
                                              "max_tokens": 37, "n": 3, "ignore_eos": True,
                                              "temperature": 0.8, "seed": 1})
    assert r.status_code == 200
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == len(tok.encode(prompt).ids)
    assert usage["completion_tokens"] == 3 * 37
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2]
    assert all(c["finish_reason"] == "length" for c in r.json()["choices"])


def test_token_id_prompt_matches_text_prompt(client, stack):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(stack["path"] / "tokenizer.json"))
    body = {"model": stack["model"], "max_tokens": 12, "temperature": 0}
    a = client.post("/v1/completions", json={**body, "prompt": "same prompt"}).json()
    b = client.post("/v1/completions",
                    json={**body, "prompt": tok.encode("same prompt").ids}).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


def test_seed_makes_sampling_reproducible(client, stack):
    body = {"model": stack["model"], "prompt": "seeded", "max_tokens": 16, "temperature": 1.0,
            "seed": 1234}
    first = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    second = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert first == second


def test_stop_sequence_ends_output(client, stack):
    body = {"model": stack["model"], "prompt": "stop test", "max_tokens": 40, "temperature": 0}
    full = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    # Filler words (" w123") are plain ASCII; a stop string of raw bytes could split a character.
    words = re.findall(r" w\d+", full)
    assert len(words) >= 2, full
    stop = words[1]
    cut = client.post("/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == full[: full.index(stop)]
