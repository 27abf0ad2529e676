"""Constants and the strict base model every config section shares."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

DEFAULT_MODEL_NAME = "tiny-llama"
# The Serve application the stack runs as (routes at "/").
APP_NAME = "llm"
VLLM_DEFAULT_MAX_NUM_SEQS = 256
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")
# A long stream must be able to finish while its replica drains (Serve's default is 20 s).
DEFAULT_DRAIN_TIMEOUT_S = 600.0
# The floor of the engine stall watch's timeout (serve_app/engine/stall.py) on GPUs: vLLM's own
# limit for one execution (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, 300 s). A step takes milliseconds
# to seconds, but a long prefill, a compile or a network hiccup in TP/PP can take minutes, and
# killing a healthy engine costs every request in it and minutes of restart.
DEFAULT_STALL_TIMEOUT_S = 300.0
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "deployments" / "local-cpu.yaml"

# vLLM options the schema sets itself; passing them through engine_kwargs would silently disagree.
_OWNED_ENGINE_KWARGS = {
    "model": "path",
    "served_model_name": "name",
    "tensor_parallel_size": "tensor_parallel_size",
    "pipeline_parallel_size": "pipeline_parallel_size",
    "distributed_executor_backend": "distributed_executor_backend",
    "enable_lora": "lora",
    "max_loras": "lora",
    "max_lora_rank": "lora",
    "max_cpu_loras": "lora",
    "scheduler_cls": "priority_before_prefill",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


