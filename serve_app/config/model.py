"""A served model's section: where its weights are, how it is sharded, its replicas and their
autoscaling."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from serve_app.config.base import (
    VLLM_DEFAULT_MAX_NUM_SEQS,
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_STALL_TIMEOUT_S,
    _OWNED_ENGINE_KWARGS,
    _Strict,
)
from serve_app.config.lora import AdapterSettings, LoraSettings
from serve_app.config.routing import RoutingSettings


class AutoscalingSettings(_Strict):
    """Replica count of one model, driven by its queue depth (:mod:`serve_app.autoscaling`).

    Demand = requests waiting in the routers' fair queues + requests in the model's engines.
    Desired replicas = ceil(demand / target_per_replica), within [min_replicas, max_replicas];
    up at once after ``upscale_delay_s`` of sustained backlog, down one replica at a time after
    ``downscale_delay_s`` and only once the others could carry the demand with room to spare.
    With ``min_replicas: 0`` a request to a cold model waits in the fair queue while the first
    replica starts, and the model returns to zero after ``idle_timeout_s`` without requests.
    """

    min_replicas: int = Field(1, ge=0, description="Replicas kept even when idle (0: scale "
                              "to zero after idle_timeout_s).")
    max_replicas: int = Field(1, ge=1, description="Upper bound on replicas of this model.")
    initial_replicas: int | None = Field(None, ge=0, description="Replicas at deploy time.")
    target_per_replica: int | None = Field(
        None, ge=1, description="Demand (queued + in the engine) one replica is sized for. "
        "None: the engine's batch limit (engine_kwargs.max_num_seqs, else 256, vLLM's "
        "default), so a replica scales out once its batch is full and work still waits.",
    )
    downscale_utilization: float = Field(
        0.7, gt=0, le=1, description="Scale down only when one replica fewer would run at most "
        "this fraction of its target: the hysteresis that stops flapping on a noisy load.",
    )
    metrics_interval_s: float = Field(
        1.0, gt=0, description="How often replicas report their load to the Serve controller.")
    look_back_period_s: float = Field(
        3.0, gt=0, description="Window the controller averages those reports over.")
    upscale_delay_s: float = Field(
        1.0, ge=0, description="Sustained backlog needed before adding replicas.")
    downscale_delay_s: float = Field(
        30.0, ge=0, description="Sustained low demand needed before removing a replica.")
    idle_timeout_s: float = Field(
        60.0, ge=0, description="With min_replicas 0: time without demand before the last "
        "replica goes.",
    )

    @model_validator(mode="after")
    def _ordered(self) -> AutoscalingSettings:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) is above max_replicas ({self.max_replicas}); "
                "raise max_replicas or lower min_replicas"
            )
        if self.initial_replicas is not None and not (
            self.min_replicas <= self.initial_replicas <= self.max_replicas
        ):
            raise ValueError("initial_replicas must lie between min_replicas and max_replicas")
        if self.look_back_period_s < self.metrics_interval_s:
            raise ValueError("look_back_period_s must be at least metrics_interval_s (the "
                             "window must hold one report); raise look_back_period_s")
        return self


def _eager_on_cpu(engine_kwargs: dict[str, Any], engine_env: dict[str, str]) -> bool:
    """Whether the vLLM CPU build would run this engine with no compile warm-up."""
    compilation = engine_kwargs.get("compilation_config")
    mode = compilation.get("mode") if isinstance(compilation, dict) else None
    return (bool(engine_kwargs.get("enforce_eager")) or mode in (0, "NONE")
            or engine_env.get("VLLM_CPU_CI_ENV", "0") not in ("", "0"))


class ModelSettings(_Strict):
    """One served model: where its weights are, how it is sharded, how many replicas."""

    name: str = Field(description="Name clients put in the `model` field; unique in the app.")
    path: str = Field(
        description="Anything vLLM can load: a hub id (`org/name`) or a local folder. Write "
        "relative folders with a leading `./`; they resolve against the repository root for "
        "files under deployments/, else against the config file's folder."
    )
    device: Literal["cpu", "gpu"] = Field("gpu", description="Where the engine runs.")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs (or CPU ranks) per stage.")
    pipeline_parallel_size: int = Field(1, ge=1, description="Pipeline stages per replica.")
    placement_strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "PACK",
        description="Ray placement strategy of a replica's bundles. PACK fills one node first "
        "and spreads to others when it is too small; STRICT_PACK keeps a replica on one node.",
    )
    distributed_executor_backend: Literal["auto", "ray", "mp"] = Field(
        "auto",
        description="How the engine runs its TP x PP ranks. `ray`: one Ray worker per GPU in the "
        "replica's placement group (may span nodes; the replica itself holds no GPU). `mp`: "
        "worker processes beside the replica on its node (the replica holds all its GPUs; one "
        "node only). `auto`: one rank runs inside the replica; more ranks use `ray` on GPUs "
        "and `mp` on CPUs (the vLLM CPU build refuses Ray).",
    )
    cpus_per_replica: int = Field(
        1, ge=1, description="CPUs reserved for a replica (on CPU: for the engine itself)."
    )
    max_ongoing_requests: int = Field(
        256, ge=1, description="Requests one replica accepts at once (Serve's limit; vLLM "
        "batches them). Keep it above the engine's batch (`max_num_seqs`) plus the router's "
        "`admission.headroom` and 2 + headroom per router replica: the router plans each "
        "engine's load within it, so below that the batch never fills."
    )
    max_model_len: int | None = Field(
        None, ge=16, description="Context length; defaults to the model's own."
    )
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Passed unchanged to vLLM's AsyncEngineArgs."
    )
    engine_env: dict[str, str] = Field(
        default_factory=dict, description="Environment variables of the replica (VLLM_*, OMP_*)."
    )
    autoscaling: AutoscalingSettings = Field(default_factory=AutoscalingSettings)
    routing: RoutingSettings = Field(
        default_factory=RoutingSettings, description="How the routers choose the engine "
        "replica of each request: `policy` (prefix_cache, the default | power_of_two | "
        "prefix_affinity), its knobs, and where LoRA adapters' requests go.")
    lora: LoraSettings | None = Field(
        None, description="LoRA in this model's engines (vLLM's enable_lora and its limits); "
        "needed by `adapters`. Changing it restarts the model's engines.")
    adapters: list[AdapterSettings] = Field(
        default_factory=list, description="LoRA adapters served on this model, each under its "
        "own model id, to its owners only. Live: adding, changing or removing one with "
        "`serve-app deploy` restarts nothing.")
    drain_timeout_s: float = Field(
        DEFAULT_DRAIN_TIMEOUT_S, gt=0, description="How long a replica chosen to go (scale-down, redeploy) may "
        "take to finish its streams; it gets no new requests meanwhile. Size it to the longest "
        "generation you allow (max_model_len tokens at your slowest per-token latency).",
    )
    priority_before_prefill: bool = Field(
        False, description="Run vLLM's scheduler with one change (serve_app/engine/"
        "vllm_scheduler.py): a waiting request that the router ranked well ahead (a quiet "
        "tenant's beside a flood) starts before lower-ranked prompts part-way through their "
        "chunked prefill, which vLLM otherwise serves first. Off until measured on a GPU "
        "(bench/RESULTS.md 42d).")
    engine_stall_timeout_s: float | None = Field(
        DEFAULT_STALL_TIMEOUT_S, gt=0, description="Floor of the engine stall watch's timeout "
        "(serve_app/engine/stall.py). A replica whose engine holds requests but finishes no "
        "step for longer than max(this, 4 x the longest step seen), at two health checks in a "
        "row, fails its health check: its engine processes are killed (the requests in it end "
        "with an error) and Serve replaces it. Catches an engine core that hangs instead of "
        "dying, such as a pipeline stage whose peer's node is gone. Default 300 s (vLLM's own "
        "limit per execution) on GPUs; off (null) by default on `device: cpu`, where a loaded "
        "machine makes long steps normal. Values below 300 s are for tests; null turns the "
        "watch off.",
    )

    @model_validator(mode="before")
    @classmethod
    def _stall_watch_off_on_cpu(cls, data: Any) -> Any:
        """`engine_stall_timeout_s` left out on `device: cpu` means off (see its description)."""
        if (isinstance(data, dict) and "engine_stall_timeout_s" not in data
                and data.get("device") == "cpu"):
            return {**data, "engine_stall_timeout_s": None}
        return data

    @field_validator("name")
    @classmethod
    def _name_ok(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}", v):
            raise ValueError(
                "use letters, digits and . _ : / - (at most 128 characters, starting with a "
                "letter or digit)"
            )
        return v

    @field_validator("engine_kwargs")
    @classmethod
    def _not_owned(cls, v: dict[str, Any]) -> dict[str, Any]:
        for key, owner in _OWNED_ENGINE_KWARGS.items():
            if key in v:
                raise ValueError(f"{key!r} is set by the schema; set the model's {owner} instead")
        if "max_model_len" in v:
            raise ValueError("set the model's max_model_len field instead of engine_kwargs")
        return v

    @model_validator(mode="after")
    def _adapters_need_lora(self) -> ModelSettings:
        if self.adapters and self.lora is None:
            raise ValueError(
                "adapters are listed but LoRA is off in this model's engines: add `lora: "
                "{max_loras: N, max_lora_rank: R}` to the model (R at least the adapters' rank)")
        names = [a.name for a in self.adapters]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"adapter names must be unique; rename the repeated {dupes}")
        return self

    @model_validator(mode="after")
    def _cpu_limits(self) -> ModelSettings:
        if self.device == "cpu" and self.pipeline_parallel_size > 1 and _eager_on_cpu(
                self.engine_kwargs, self.engine_env):
            # vLLM's CPU worker allocates a later stage's buffer for the activations it
            # receives only in its compile warm-up, which eager mode skips: the stage then
            # fails its first step (`assert self.intermediate_tensors is not None`).
            raise ValueError(
                "pipeline_parallel_size > 1 on the vLLM CPU build needs its compile warm-up: "
                "drop enforce_eager (and VLLM_CPU_CI_ENV) and set engine_kwargs.compilation_config"
                " to {mode: 2, backend: eager} (a one-pass trace, no compile; "
                "deployments/local-cpu-pp2.yaml)"
            )
        if self.device == "cpu" and self.distributed_executor_backend == "ray":
            raise ValueError(
                "distributed_executor_backend: ray is refused by the vLLM CPU build (\"current "
                "platform cpu does not support ray\"); use `mp` or `auto` for device: cpu"
            )
        return self

    @property
    def world_size(self) -> int:
        """Engine ranks of one replica: tensor x pipeline parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor_backend(self) -> Literal["uni", "ray", "mp"]:
        """The executor vLLM is given: `uni` (the engine's one rank in the replica's process
        tree), `ray` or `mp` (see ``distributed_executor_backend``)."""
        if self.distributed_executor_backend != "auto":
            return self.distributed_executor_backend
        if self.world_size == 1:
            return "uni"
        return "ray" if self.device == "gpu" else "mp"

    @property
    def target_per_replica(self) -> int:
        """Demand one replica is sized for (see :class:`AutoscalingSettings`)."""
        return self.autoscaling.target_per_replica or int(
            self.engine_kwargs.get("max_num_seqs") or VLLM_DEFAULT_MAX_NUM_SEQS)


