"""On a GPU host: the app from deployments/gpu-1.yaml serves streamed chat on the Llama-3.1-8B
shape (dummy weights). Skipped where CUDA is missing. Run: python -m pytest -v tests/gpu"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gpu_stack(tmp_path_factory):
    import ray
    from openai import OpenAI
    from ray import serve

    from serve_app.app import APP_NAME, build_app
    from serve_app.config import load_config
    from serve_app.models import write_model

    cfg = load_config(REPO / "deployments" / "gpu-1.yaml")
    model = cfg.models[0]
    if not Path(model.path).exists():
        write_model("llama-3.1-8b", Path(model.path))
    port = _free_port()
    cfg = cfg.model_copy(update={"router": cfg.router.model_copy(update={"port": port})})
    import os

    from serve_app.app import ray_env

    os.environ.update(ray_env(cfg))
    ray.init(include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(cfg), name=APP_NAME, route_prefix="/", blocking=False)
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    deadline = time.time() + 480
    while time.time() < deadline:
        try:
            client.models.list()
            break
        except Exception:
            time.sleep(2)
    yield client, model.name
    serve.shutdown()
    ray.shutdown()


def test_streamed_chat_on_8b_shape(gpu_stack):
    client, model = gpu_stack
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, max_tokens=64, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": "Tell me about GPUs."}])
    first = None
    chunks = []
    for c in stream:
        if first is None and c.choices and c.choices[0].delta.content:
            first = time.perf_counter() - t0
        chunks.append(c)
    total = time.perf_counter() - t0
    assert chunks[-1].usage.completion_tokens == 64
    print(f"\nTTFT {first * 1000:.1f} ms, 64 tokens in {total * 1000:.1f} ms")


def test_concurrent_streams(gpu_stack):
    from concurrent.futures import ThreadPoolExecutor

    client, model = gpu_stack

    def one(i: int) -> int:
        s = client.chat.completions.create(
            model=model, max_tokens=32, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True}, messages=[{"role": "user", "content": f"hi {i}"}])
        return [c for c in s][-1].usage.completion_tokens

    with ThreadPoolExecutor(32) as pool:
        assert list(pool.map(one, range(64))) == [32] * 64
