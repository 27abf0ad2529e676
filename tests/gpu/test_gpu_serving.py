"""On a GPU host: the app from a GPU deployment config (deployments/gpu-1.yaml unless
SERVE_APP_GPU_CONFIG names another) serves streamed chat on the Llama-3.1-8B shape (dummy weights),
and each replica holds exactly one placement group. SERVE_APP_GPU_EXECUTOR=ray forces vLLM's Ray
executor (the one-GPU proof that the replica's group reaches it); SERVE_APP_GPU_ADDRESS joins a
running Ray cluster instead of starting one. Skipped where CUDA is missing.
Run: python -m pytest -v tests/gpu"""

from __future__ import annotations

import json
import os
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
    from openai import OpenAI

    from serve_app.config import load_config
    from serve_app.launch import start_stack, stop_stack
    from serve_app.models import write_model

    cfg = load_config(REPO / os.environ.get("SERVE_APP_GPU_CONFIG", "deployments/gpu-1.yaml"))
    model = cfg.models[0]
    if os.environ.get("SERVE_APP_GPU_EXECUTOR"):
        model = model.model_copy(update={
            "distributed_executor_backend": os.environ["SERVE_APP_GPU_EXECUTOR"]})
        cfg = cfg.model_copy(update={"models": [model]})
    if not Path(model.path).exists():
        write_model("llama-3.1-8b", Path(model.path))
    router = cfg.router.model_copy(update={"host": "127.0.0.1", "port": _free_port()})
    # SERVE_APP_GPU_ADDRESS: join a running cluster (bench/gpu_parallel.sh's two Ray nodes).
    base = start_stack(cfg.model_copy(update={"router": router}),
                       address=os.environ.get("SERVE_APP_GPU_ADDRESS"))
    client = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    deadline = time.time() + 480
    while time.time() < deadline:
        try:
            client.models.list()
            break
        except Exception:
            time.sleep(2)
    yield client, model
    stop_stack()


def test_streamed_chat_on_8b_shape(gpu_stack):
    client, settings = gpu_stack
    model = settings.name
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

    client, settings = gpu_stack
    model = settings.name

    def one(i: int) -> int:
        s = client.chat.completions.create(
            model=model, max_tokens=32, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True}, messages=[{"role": "user", "content": f"hi {i}"}])
        return [c for c in s][-1].usage.completion_tokens

    with ThreadPoolExecutor(32) as pool:
        assert list(pool.map(one, range(64))) == [32] * 64


def test_one_placement_group_per_replica(gpu_stack):
    """Serve's reservation is the only one, and the engine's GPUs are the group's: with the Ray
    executor the replica actor holds no GPU, so a group GPU in use is vLLM's worker inside it."""
    import ray
    from ray._private.state import actors
    from ray.util import placement_group_table

    _, settings = gpu_stack
    groups = placement_group_table()
    available = ray.available_resources()
    if os.environ.get("OUT"):  # the record for bench/RESULTS.md
        with open(os.path.join(os.environ["OUT"], "placement.json"), "w") as f:
            json.dump({"executor": settings.executor_backend, "placement_groups": groups,
                       "actors": sorted(f"{a['ActorClassName']} {a['State']}"
                                        for a in actors().values()),
                       "available": available, "total": ray.cluster_resources()},
                      f, indent=1, default=str)
    replicas = settings.autoscaling.min_replicas
    assert len(groups) == replicas, groups  # none removed, none pending: no second attempt
    assert all(g["state"] == "CREATED" for g in groups.values()), groups
    gpus = sum(b.get("GPU", 0) for g in groups.values() for b in g["bundles"].values())
    assert gpus == settings.world_size * replicas
    for group_id in groups:  # every GPU of every group is taken by the engine's ranks
        assert available.get(f"GPU_group_{group_id}", 0) == 0, available
    # ... and no GPU outside the groups is.
    assert ray.cluster_resources().get("GPU", 0) - available.get("GPU", 0) == gpus
    # SERVE_APP_GPU_REPLICA_NODES=N: each replica's GPU bundles lie on N nodes (two Ray nodes of
    # one GPU each and PP=2: one stage per node).
    if os.environ.get("SERVE_APP_GPU_REPLICA_NODES"):
        for g in groups.values():
            nodes = {g["bundles_to_node_id"][i] for i, b in g["bundles"].items() if b.get("GPU")}
            assert len(nodes) == int(os.environ["SERVE_APP_GPU_REPLICA_NODES"]), g
