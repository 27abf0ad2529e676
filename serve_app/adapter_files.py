"""LoRA adapter folders in PEFT's format: the tiny adapter the project writes itself (the
reading of a folder's ``adapter_config.json`` lives with the schema that checks it:
:func:`serve_app.config.lora.read_adapter_config`).

A PEFT adapter folder holds ``adapter_config.json`` (``peft_type: LORA``, rank ``r``,
``lora_alpha``, ``target_modules``) and ``adapter_model.safetensors`` with, per adapted
module, ``base_model.model.<module>.lora_A.weight`` (r x in) and ``lora_B.weight`` (out x r).
vLLM loads exactly that (``vllm.lora.peft_helper``). The tiny adapter targets the tiny Llama's
``q_proj`` and ``v_proj`` with real random weights, deterministic from a seed and large enough
that greedy output differs from the base model's (tests/integration/test_lora.py checks it).
No download at any point.
"""

from __future__ import annotations

import json
from pathlib import Path

from serve_app.config.lora import ADAPTER_CONFIG, read_adapter_config

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "read_adapter_config", "write_tiny_adapter"]

ADAPTER_WEIGHTS = "adapter_model.safetensors"
TINY_ADAPTER_RANK = 8
TINY_TARGET_MODULES = ("q_proj", "v_proj")
# Standard deviation of the A and B factors. With lora_alpha = 2 r the update B A adds about
# 2 sqrt(r) std^2 per weight: 0.2 gives ~0.23 beside the base's 0.08, enough to change the
# tiny model's greedy tokens from the first few on.
TINY_ADAPTER_STD = 0.2
_MARKER = ".serve_app_adapter.json"


def write_tiny_adapter(folder: Path, base: Path, seed: int = 1,
                       rank: int = TINY_ADAPTER_RANK) -> Path:
    """Write a LoRA adapter for the Llama at ``base`` (its ``config.json`` alone gives the
    shapes: the tiny model or a config-only shape such as ``llama-3.1-8b``) into ``folder``: PEFT's two files, weights deterministic from ``seed``. Idempotent:
    a folder written with the same seed and rank is left as it is."""
    import torch
    from safetensors.torch import save_file

    marker = folder / _MARKER
    if marker.exists() and json.loads(marker.read_text()) == {"seed": seed, "rank": rank}:
        return folder
    cfg = json.loads((base / "config.json").read_text())
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    outs = {"q_proj": heads * head_dim,
            "v_proj": int(cfg.get("num_key_value_heads") or heads) * head_dim}
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * TINY_ADAPTER_STD).contiguous()

    tensors: dict[str, torch.Tensor] = {}
    for layer in range(int(cfg["num_hidden_layers"])):
        for module in TINY_TARGET_MODULES:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = normal(rank, hidden)
            tensors[f"{prefix}.lora_B.weight"] = normal(outs[module], rank)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (folder / ADAPTER_CONFIG).write_text(json.dumps({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(TINY_TARGET_MODULES),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }, indent=2))
    marker.write_text(json.dumps({"seed": seed, "rank": rank}))
    return folder
