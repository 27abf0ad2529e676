"""The bare-vLLM arm of a comparison gets exactly the stack's engine arguments.

Both arms are derived from one deployment config, so a difference in flags (ray PR #55159: a
wrapper silently got max_num_seqs=128 instead of 1024) cannot creep in.

usage: python -m serve_bench.arms deployments/gpu-1.yaml
  -> prints `env K=V ... vllm serve` arguments: the model's engine_env, then the engine flags
"""

from __future__ import annotations

import json
import shlex
import sys
from typing import Any

from serve_app.config import ModelSettings, load_config
from serve_app.engine.vllm_adapter import engine_args_for


def vllm_serve_argv(settings: ModelSettings) -> list[str]:
    """``vllm serve`` arguments equivalent to the stack's AsyncEngineArgs for ``settings``."""
    kwargs: dict[str, Any] = engine_args_for(settings)
    argv = [str(kwargs.pop("model"))]
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, (dict, list)):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def bare_vllm_command(settings: ModelSettings, python: str = sys.executable) -> list[str]:
    """The whole bare-arm command line: the replica's environment, then ``vllm serve``."""
    env = [f"{k}={v}" for k, v in settings.engine_env.items()]
    return ["env", *env, python, "-m", "serve_app.cli", "vllm", "serve",
            *vllm_serve_argv(settings)]


if __name__ == "__main__":
    cfg = load_config(sys.argv[1])
    print(shlex.join(bare_vllm_command(cfg.models[0])))
