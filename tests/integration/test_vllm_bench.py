"""`vllm bench serve`, the tool users already run, works against the endpoint unchanged."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("backend, endpoint", [
    ("openai", "/v1/completions"),
    # 13 s; the make-test tier's chat path: the openai client, parity and disconnect tests
    pytest.param("openai-chat", "/v1/chat/completions", marks=pytest.mark.long)])
def test_vllm_bench_serve_has_no_failures(stack, tmp_path, backend, endpoint):
    cmd = [sys.executable, "-m", "serve_app.cli", "vllm", "bench", "serve",
           "--backend", backend, "--base-url", stack["base"], "--endpoint", endpoint,
           "--model", stack["model"], "--tokenizer", str(stack["path"]),
           "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "16",
           "--num-prompts", "24", "--max-concurrency", "8", "--ignore-eos",
           "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"]
    # vllm bench serve sends OPENAI_API_KEY as the bearer key, as users run it.
    env = {**os.environ, "OPENAI_API_KEY": stack["key"]}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] == 24
    assert result.get("failed", 0) == 0
    assert result["total_output_tokens"] == 24 * 16
