"""A model's LoRA sections: ``lora:`` (the engine's LoRA limits: part of the engine, changing
it restarts the model's engines) and ``adapters:`` (the adapters served on it, each with its
owners: live, adding or removing one restarts nothing: serve_app/governance/live_config.py).

Which tenant may use an adapter, and the checks that need the filesystem (a local adapter
folder's ``adapter_config.json`` and its rank), are the whole config's business
(:mod:`serve_app.config.app`)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from serve_app.config.base import _Strict

ADAPTER_CONFIG = "adapter_config.json"
# An adapter owner that means every tenant (and the anonymous one of an open endpoint).
PUBLIC = "public"
# The ranks vLLM's LoRA kernels are built for (vllm.config.lora.MaxLoRARanks).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")


def adapter_id(model: str, name: str, path: str) -> int:
    """The int id vLLM knows an adapter by (``LoRARequest.lora_int_id``, 1 .. 2**31 - 1): a
    digest of the model, the adapter's name and its path, so it is the same on every router
    and engine and through any live change that adds or removes other adapters (an id from
    the config's order would shift, and an engine would serve another adapter's weights
    cached under the old id); a changed path is a new adapter to vLLM, whose cache holds
    weights by id. Two adapters of one model with the same id are refused at load
    (:meth:`serve_app.config.AppConfig`); the chance is about n^2 / 2^32 for n adapters."""
    digest = hashlib.sha256(f"{model}\0{name}\0{path}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % (2**31 - 1) + 1


class LoraSettings(_Strict):
    """LoRA in a model's engines: set, the engines start with vLLM's ``enable_lora`` and these
    limits; unset, the model serves no adapter. Part of the engine's arguments: a change
    restarts the model's engines (adding adapters does not)."""

    max_loras: int = Field(1, ge=1, description="Adapters one engine runs in the same batch "
                           "(vLLM's max_loras): a request for another waits until a slot "
                           "frees, then the least recently used adapter is swapped out.")
    max_lora_rank: int = Field(16, description="Highest adapter rank the engine accepts "
                               f"(vLLM's max_lora_rank, one of {list(LORA_RANKS)}); memory "
                               "for max_loras adapters of this rank is reserved at start.")
    max_cpu_loras: int | None = Field(None, ge=1, description="Adapters an engine keeps "
                                      "loaded in host memory (vLLM's max_cpu_loras, at least "
                                      "max_loras; None: max_loras). Beyond it the least "
                                      "recently used is dropped and read from its path again "
                                      "when asked for.")

    @field_validator("max_lora_rank")
    @classmethod
    def _rank_ok(cls, v: int) -> int:
        if v not in LORA_RANKS:
            raise ValueError(f"vLLM accepts one of {list(LORA_RANKS)}; pick the smallest at "
                             "least your adapters' rank")
        return v

    @model_validator(mode="after")
    def _cpu_at_least_gpu(self) -> LoraSettings:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least "
                             f"max_loras ({self.max_loras})")
        return self


class AdapterSettings(_Strict):
    """One LoRA adapter served on its model, under its own model id."""

    name: str = Field(description="The id clients put in `model` to use the adapter; unique "
                      "in the app, and no model's name.")
    path: str = Field(description="A local PEFT adapter folder (adapter_config.json + "
                      "adapter_model.safetensors; relative folders with a leading `./`, "
                      "resolved like a model's path) or a hub id (`org/name`, loaded by vLLM "
                      "when first asked for). A local folder is checked at load time.")
    owners: list[str] = Field(min_length=1, description="Tenants that may use the adapter "
                              f"(and see it in /v1/models), or `{PUBLIC}` for every tenant. "
                              "Others get 404, as for a model that does not exist.")

    @field_validator("name")
    @classmethod
    def _name_ok(cls, v: str) -> str:
        if not _NAME.fullmatch(v):
            raise ValueError("use letters, digits and . _ : / - (at most 128 characters, "
                             "starting with a letter or digit)")
        return v

    @property
    def public(self) -> bool:
        return PUBLIC in self.owners


def read_adapter_config(folder: Path) -> dict[str, Any]:
    """``folder``'s ``adapter_config.json``, checked for what vLLM needs of it: a LoRA
    (``peft_type``), an integer rank ``r`` and ``target_modules``. Raises ValueError saying
    what is missing (the config's validation puts the field's name in front)."""
    path = folder / ADAPTER_CONFIG
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder (a local adapter is a folder holding "
                         f"{ADAPTER_CONFIG}; a hub id is written org/name)")
    if not path.is_file():
        raise ValueError(f"{folder} has no {ADAPTER_CONFIG}: not a PEFT adapter folder "
                         "(`serve-app make-adapter` writes one)")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} is not readable JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    if str(data.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"{path}: peft_type is {data.get('peft_type')!r}; only LORA is served")
    rank = data.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{path}: `r` (the rank) must be a positive integer, not {rank!r}")
    if not data.get("target_modules"):
        raise ValueError(f"{path}: `target_modules` is missing")
    return data
