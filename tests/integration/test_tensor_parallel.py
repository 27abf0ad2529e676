"""Tensor parallelism 2 inside one Serve replica on the vLLM CPU build: a second app whose engine
runs two ranks (multiprocessing executor, one thread set per rank) gives the same greedy output
as the suite's single-rank engine on the same model and prompts."""

from __future__ import annotations

import httpx
import pytest

from .conftest import REPO, wait_until
from .load import greedy_completions

pytestmark = [pytest.mark.integration, pytest.mark.long]  # `make test-long`

APP = "tp2"
PREFIX = "/tp2"
MODEL = "tiny-tp2"
PROMPTS = ["The quick brown fox", "Tensor parallel ranks split each layer's heads", "0123456789"]


@pytest.fixture(scope="module")
def tp2(stack):
    from ray import serve

    from serve_app.app import build_app
    from serve_app.config import load_config

    base_cfg = load_config(REPO / "deployments" / "local-cpu.yaml")
    single = base_cfg.models[0]
    model = single.model_copy(update={
        "name": MODEL, "tensor_parallel_size": 2, "cpus_per_replica": 2,
        # One OpenMP thread set per rank (without it the CPU build refuses to start two ranks:
        # "Not enough allowed NUMA nodes").
        "engine_env": {**single.engine_env, "VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    })
    cfg = base_cfg.model_copy(update={"models": [model]})
    serve.run(build_app(cfg), name=APP, route_prefix=PREFIX, blocking=False)
    base = stack["base"] + PREFIX
    wait_until(lambda: _ready(base), 300, 1)
    yield base
    serve.delete(APP)


def _ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/v1/models", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _greedy(base: str, model: str, headers: dict[str, str] | None = None) -> list[tuple]:
    return greedy_completions(base, model, PROMPTS, headers)


def test_tp2_replica_matches_single_rank_greedy_output(stack, tp2):
    single = _greedy(stack["base"], stack["model"], stack["headers"])
    split = _greedy(tp2, MODEL)
    assert split == single
    assert all(tokens == 24 and text for text, tokens in split)
