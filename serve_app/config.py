"""One pydantic schema for a whole deployment, loaded from YAML under ``deployments/``.

A wrong config fails at load time (:func:`load_config`) with a message that names the field and
says what to change; nothing is discovered half-way through starting replicas.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

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
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "deployments" / "local-cpu.yaml"

# vLLM options the schema sets itself; passing them through engine_kwargs would silently disagree.
_OWNED_ENGINE_KWARGS = {
    "model": "path",
    "served_model_name": "name",
    "tensor_parallel_size": "tensor_parallel_size",
    "pipeline_parallel_size": "pipeline_parallel_size",
    "distributed_executor_backend": "distributed_executor_backend",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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
        256, ge=1, description="Requests one replica accepts at once (vLLM batches them)."
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
    drain_timeout_s: float = Field(
        DEFAULT_DRAIN_TIMEOUT_S, gt=0, description="How long a replica chosen to go (scale-down, redeploy) may "
        "take to finish its streams; it gets no new requests meanwhile. Size it to the longest "
        "generation you allow (max_model_len tokens at your slowest per-token latency).",
    )
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


class AdmissionSettings(_Strict):
    """When the router releases a queued request to a model's engines (serve_app/admission/)."""

    policy: Literal["engine_feedback", "fixed"] = Field(
        "engine_feedback", description="`engine_feedback`: release requests only while the "
        "engines start what they are sent (their waiting queues stay within `headroom`), so "
        "the backlog waits in the router's fair queue and capacity follows the live replicas. "
        "`fixed`: the model's max_ongoing_requests per live replica (the baseline).",
    )
    headroom: int = Field(
        4, ge=1, description="Requests per replica the router lets wait inside an engine, so "
        "it always has work to start at its next step (at least one step's worth of prompts: "
        "max_num_batched_tokens / recent prompt length). Also how many first requests of "
        "tenants with nothing in flight may be out beyond capacity at once (each then starts "
        "at the engine's next step, ahead of queued floods, by its engine priority).",
    )
    kv_cache_high: float = Field(
        0.95, gt=0, le=1, description="KV-cache use above which an engine counts as saturated: "
        "it gets what it runs, plus what its next step can start, plus `headroom` "
        "(docs/admission.md).",
    )
    poll_interval_s: float = Field(
        0.02, gt=0, description="How often the router reads the engines' load while it has "
        "requests in flight or queued (a broadcast of one small call to each replica).",
    )
    idle_poll_interval_s: float = Field(
        0.5, gt=0, description="The same when the model is idle (it also reports the router's "
        "backlog to the autoscaler).",
    )
    cold_start_timeout_s: float = Field(
        600.0, gt=0, description="A request waiting while its model has no live replica gets "
        "503 with Retry-After after this long (a replica start takes minutes on GPUs).",
    )


class RouterSettings(_Strict):
    """The OpenAI ingress (router) deployment."""

    host: str = Field("127.0.0.1", description="Address the HTTP proxy binds.")
    port: int = Field(8000, ge=1, le=65535, description="Port of the OpenAI endpoint.")
    num_replicas: int = Field(1, ge=1, description="Router replicas (each is a FastAPI app).")
    resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources each router replica needs, "
        "e.g. {head: 0.01} with the head started with `--resources '{\"head\": 1}'`: keeps "
        "routers off the GPU nodes, so that losing one costs its engine replicas only, not every "
        "request that a router there was carrying.")
    max_ongoing_requests: int = Field(
        4096, ge=1, description="Requests one router replica holds at once."
    )
    max_body_bytes: int = Field(
        1_000_000, ge=1024, description="Larger request bodies get 413 before being parsed."
    )
    max_n: int = Field(16, ge=1, description="Largest `n` (choices per request) accepted.")
    max_in_flight_per_model: int | None = Field(
        None, ge=1, description="Upper bound on sequences of one model in its engines at once "
        "(a request counts its `n`), over all router replicas (None: no bound beyond "
        "`admission`, which follows the engines' live load). The rest wait in the router's "
        "fair queue.",
    )
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    queue_policy: Literal["fair", "fifo"] = Field(
        "fair", description="Order of requests waiting in the router: `fair` (priority bands, "
        "then the least-served tenant) or `fifo` (arrival order; the baseline to compare with).",
    )
    max_queued_per_band: int = Field(
        4096, ge=0, description="Requests one priority band may hold waiting per model; "
        "beyond it new requests of that band get 429.",
    )
    allow_open_endpoint: bool = Field(
        False, description="Serve a non-loopback `host` with no tenants (anyone who reaches "
        "the port uses the GPUs without a key). Refused unless set: add `tenants:` instead.",
    )
    stream_stall_timeout_s: float = Field(
        60.0, gt=0, description="A streamed response whose client accepts no bytes for this "
        "long is cut (status 408 in the tenant metrics) and its engine work aborted: a reader "
        "that stopped or trickles holds an admission slot, KV cache and router memory until "
        "then. Counted from a write the client did not take; the kernel's and HAProxy's "
        "buffers take a few MB of a stream first (bench/RESULTS.md section 9c). Waiting for "
        "the engine never counts.",
    )
    server_timing: bool = Field(
        False, description="Send a `Server-Timing` header on generation responses: the "
        "request's router queue wait, the hop to its replica and the engine's phases up to "
        "its first token, in ms (see serve_app/engine/timing.py). Off by default: the engine "
        "queue times it shows reflect other tenants' load.",
    )
    proxy_location: Literal["EveryNode", "HeadOnly"] = Field(
        "EveryNode", description="Where Serve runs its HTTP ingress (HAProxy): on every node "
        "(clients or a load balancer may reach any node) or on the head node only (one "
        "address; also the choice when several Ray nodes share one machine, whose ingresses "
        "would all bind `port`). Set when Serve first starts on a cluster.",
    )
    output_channels: bool = Field(
        True, description="Streamed chunks after a request's first travel from each engine "
        "replica to each router replica batched: one message per engine step instead of one "
        "per stream (serve_app/engine/channel.py). Off: one Serve stream message per chunk.",
    )
    high_throughput: bool = Field(
        True,
        description="Ray Serve's high-throughput data plane: HAProxy ingress instead of the "
        "Python HTTP proxy, gRPC between replicas, direct ingress. Set on every node before "
        "Ray starts (serve-app run does it for a local instance).",
    )
    haproxy_admin_host: str = Field(
        "127.0.0.1", description="Address HAProxy's stats page (no authentication) and its "
        "Prometheus exporter bind (serve_app/ingress/haproxy.py). Loopback by default; "
        "`0.0.0.0` (or one interface's address) opens them, e.g. for a Prometheus on another "
        "host. The OpenAI port is `host`.",
    )
    haproxy_stats_port: int = Field(
        8404, ge=1, le=65535, description="Port of HAProxy's stats page. Two stacks on one "
        "host need different ones.",
    )
    haproxy_metrics_port: int = Field(
        9101, ge=1, le=65535, description="Port of HAProxy's Prometheus exporter. Two stacks "
        "on one host need different ones.",
    )
    fallback_proxy_port: int = Field(
        8500, ge=1, le=65535, description="Port of Serve's fallback HTTP proxy on the head "
        "node (HAProxy sends requests there while no router replica is up), on `host`. Two "
        "stacks on one host need different ones.",
    )

    @field_validator("haproxy_admin_host")
    @classmethod
    def _admin_host(cls, value: str) -> str:
        if not re.fullmatch(r"[0-9A-Za-z.:*-]{1,253}", value):
            raise ValueError(f"{value!r} is not an IP address or host name; use e.g. "
                             "127.0.0.1 (the default) or 0.0.0.0")
        return value

    @model_validator(mode="after")
    def _distinct_ports(self) -> RouterSettings:
        ports = {"port": self.port, "haproxy_stats_port": self.haproxy_stats_port,
                 "haproxy_metrics_port": self.haproxy_metrics_port,
                 "fallback_proxy_port": self.fallback_proxy_port}
        seen: dict[int, str] = {}
        for name, port in ports.items():
            if port in seen:
                raise ValueError(f"router.{name} and router.{seen[port]} are both {port}; "
                                 "give each its own port")
            seen[port] = name
        return self

    @field_validator("resources")
    @classmethod
    def _custom_resources(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if name in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ValueError(f"router.resources: {name} is not a custom resource; a router "
                                 "reserves no CPU or GPU (leave it out)")
            if amount <= 0:
                raise ValueError(f"router.resources.{name}: {amount} must be > 0")
        return value


Priority = Literal["high", "normal", "low"]


class TenantSettings(_Strict):
    """One tenant: the API keys that act for it and the limits it is held to.

    Keys are stored only as SHA-256 hex digests (``serve-app keys new TENANT`` prints a fresh key
    and its digest); the config never holds a usable key.
    """

    name: str = Field(description="Tenant name, as it appears in metrics and logs.")
    api_key_sha256: list[str] = Field(
        min_length=1, description="SHA-256 hex digests of the tenant's API keys."
    )
    priority: Priority = Field("normal", description="Priority class of the tenant's requests.")
    requests_per_minute: int | None = Field(
        None, ge=1, description="Requests admitted per minute (token bucket; None = no limit)."
    )
    tokens_per_minute: int | None = Field(
        None, ge=1, description="Prompt + completion tokens per minute (None = no limit). "
        "Tokens are counted when a request ends; a tenant over its budget waits until it "
        "refills.",
    )
    models: list[str] | None = Field(
        None, description="Models the tenant may use (None = all). Others look nonexistent."
    )

    @field_validator("name")
    @classmethod
    def _tenant_name_ok(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", v):
            raise ValueError("use letters, digits and . _ - (at most 64 characters)")
        return v

    @field_validator("api_key_sha256")
    @classmethod
    def _digests(cls, v: list[str]) -> list[str]:
        for d in v:
            if not re.fullmatch(r"[0-9a-f]{64}", d):
                raise ValueError(
                    "each entry is a SHA-256 hex digest (64 lowercase hex characters), not a key; "
                    "`serve-app keys new TENANT` prints one"
                )
        return v


class AppConfig(_Strict):
    """A whole deployment: the models it serves, its router and its tenants."""

    models: list[ModelSettings] = Field(min_length=1, description="Models served by this app.")
    router: RouterSettings = Field(default_factory=RouterSettings)
    tenants: list[TenantSettings] = Field(
        default_factory=list,
        description="Tenants and their keys. Empty: the endpoint is open (no key needed, no "
        "quotas; every request counts as tenant `anonymous`). Otherwise every /v1 request needs "
        "`Authorization: Bearer <key>` of a listed tenant.",
    )

    @model_validator(mode="after")
    def _unique_names(self) -> AppConfig:
        names = [m.name for m in self.models]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"model names must be unique; rename the repeated {dupes}")
        tenants = [t.name for t in self.tenants]
        dupes = sorted({n for n in tenants if tenants.count(n) > 1})
        if dupes:
            raise ValueError(f"tenant names must be unique; rename the repeated {dupes}")
        if (not self.tenants and not self.router.allow_open_endpoint
                and self.router.host not in LOOPBACK_HOSTS):
            raise ValueError(
                f"router.host is {self.router.host!r} and no tenants are configured: anyone who "
                "reaches the port could use the model without a key. Add `tenants:` (see "
                "`serve-app keys new TEAM`), bind `router.host: 127.0.0.1`, or set "
                "`router.allow_open_endpoint: true` if that is really what you want")
        digests = [d for t in self.tenants for d in t.api_key_sha256]
        if len(digests) != len(set(digests)):
            raise ValueError("an API key digest is listed for more than one tenant (or twice)")
        for t in self.tenants:
            unknown = sorted(set(t.models or []) - set(names))
            if unknown:
                raise ValueError(f"tenant {t.name} lists models that are not served: {unknown}")
        return self

    def model(self, name: str) -> ModelSettings | None:
        """The model served under ``name``, or None."""
        return next((m for m in self.models if m.name == name), None)


class ConfigError(ValueError):
    """A config that cannot be served; the message names the field and the fix."""


def _format_validation_error(source: str, err: ValidationError) -> str:
    lines = [f"{source}: invalid deployment config"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field; check its spelling against serve_app/config.py"
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def parse_config(data: Any, source: str = "<config>", base_dir: Path | None = None) -> AppConfig:
    """Validate ``data`` (a mapping as read from YAML) into an :class:`AppConfig`.

    Relative model paths that exist under ``base_dir`` are made absolute, so the config means
    the same wherever the process starts. Raises :class:`ConfigError` with one line per problem.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a deployment config is a mapping with a `models` list")
    try:
        cfg = AppConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(source, err)) from None
    if base_dir is None:
        return cfg
    models = []
    for m in cfg.models:
        p = Path(m.path)
        if not p.is_absolute() and (m.path.startswith(".") or (base_dir / p).exists()):
            m = m.model_copy(update={"path": str((base_dir / p).resolve())})
        models.append(m)
    return cfg.model_copy(update={"models": models})


# A file of tenants that load_config adds to the config's own `tenants:` (a Kubernetes Secret
# mounted into the pods: deployments/kuberay/rayservice.yaml). Set: the file must exist.
TENANTS_FILE_ENV = "SERVE_APP_TENANTS_FILE"


def tenants_from_file(path: Path) -> list[Any]:
    """The tenant entries of ``path``: YAML holding a mapping with a ``tenants:`` list (the same
    entries as a config's ``tenants:``, keys as SHA-256 digests), or that list alone. Validated
    with the config they join. Raises ConfigError naming the file and the variable."""
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{TENANTS_FILE_ENV}={path}: no such file (mount the tenants Secret "
                          f"there, or unset {TENANTS_FILE_ENV})") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{TENANTS_FILE_ENV}={path}: not valid YAML: {err}") from None
    if isinstance(data, dict) and set(data) == {"tenants"}:
        data = data["tenants"]
    if not isinstance(data, list):
        raise ConfigError(f"{TENANTS_FILE_ENV}={path}: write a `tenants:` list (the entries of "
                          "a config's `tenants:`; `serve-app keys new TEAM` prints one)")
    return data


def load_config(path: str | Path) -> AppConfig:
    """Read and validate a deployment YAML file. Relative model paths resolve against the repo
    root when the file lies under ``deployments/`` (at any depth), else against the file's folder.
    With ``SERVE_APP_TENANTS_FILE`` set, that file's tenants join the config's
    (:func:`tenants_from_file`)."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    tenants_file = os.environ.get(TENANTS_FILE_ENV)
    if tenants_file and isinstance(data, dict):
        data = {**data, "tenants": [*(data.get("tenants") or []),
                                    *tenants_from_file(Path(tenants_file))]}
    base = path.resolve().parent
    # Any depth under deployments/ (deployments/kuberay/...): the repository root.
    under = next((p for p in (base, *base.parents) if p.name == "deployments"), None)
    if under is not None:
        base = under.parent
    return parse_config(data, source=str(path), base_dir=base)
