"""A whole deployment: tenants, models and router together, and loading it from YAML.

A wrong config fails at load time (:func:`load_config`) with a message that names the field and
says what to change; nothing is discovered half-way through starting replicas.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from serve_app.config.base import LOOPBACK_HOSTS, _Strict
from serve_app.config.governance import GovernanceSettings
from serve_app.config.lora import PUBLIC, AdapterSettings, adapter_id, read_adapter_config
from serve_app.config.model import ModelSettings
from serve_app.config.router import RouterSettings


Priority = Literal["high", "normal", "low"]


class TokenBudget(_Strict):
    """Tokens a tenant may use per calendar window (UTC): a request reserves its prompt's
    estimate and its most output at admission, is charged prompt + completion tokens as they
    flow and settles at its end (serve_app/governance/accounting.py); spent, the tenant gets 429
    `insufficient_quota` until the window ends."""

    tokens: int = Field(ge=1, description="Prompt + completion tokens per period.")
    period: Literal["day", "month"] = Field(
        description="`day` (resets at midnight UTC) or `month` (the first, UTC).")


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
        "Tokens are counted as they flow (a client that leaves during prefill pays its "
        "prompt); a tenant over its limit gets 429 until the bucket refills.",
    )
    models: list[str] | None = Field(
        None, description="Models the tenant may use (None = all). Others look nonexistent."
    )
    token_budget: TokenBudget | None = Field(
        None, description="A budget over a day or a month, e.g. {tokens: 1000000, period: "
        "month}. Its spend is kept in the cluster's key-value store, so a restart or a "
        "redeploy does not refill it (None = no budget).",
    )
    max_concurrent_requests: int | None = Field(
        None, ge=1, description="Sequences (a request counts its `n`) the tenant may have in "
        "the engines at once, over all models (None = no cap). Requests beyond it wait in the "
        "tenant's queue, not refused; other tenants pass them. With several router replicas "
        "the cap holds for the app: they lease its slots from the quota actor as their "
        "requests need them (each its share, at least 1, with `quota_scope: replica` or "
        "while the actor does not answer).",
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
    governance: GovernanceSettings = Field(
        default_factory=GovernanceSettings, description="Usage records (billing) and budgets' "
        "storage: docs/operations.md#governing-tenants.")
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
        self._adapters_ok(set(names), set(tenants))
        return self

    def _adapters_ok(self, models: set[str], tenants: set[str]) -> None:
        """Adapter ids are model ids: unique in the app and no model's; owners are tenants.
        Messages start with the field's path (_format_validation_error prints them so)."""
        seen: dict[str, str] = {}
        for i, m in enumerate(self.models):
            ids: dict[int, str] = {}
            for j, a in enumerate(m.adapters):
                where = f"models.{i}.adapters.{j}"
                same = ids.setdefault(adapter_id(m.name, a.name, a.path), a.name)
                if same != a.name:  # vLLM would serve one's weights for the other
                    raise ValueError(f"{where}.name: {a.name!r} and {same!r} get the same "
                                     "adapter id (a digest); rename one of them")
                if a.name in models:
                    raise ValueError(f"{where}.name: {a.name!r} is a model's name; adapters "
                                     "are served as model ids, so rename the adapter")
                if a.name in seen:
                    raise ValueError(f"{where}.name: {a.name!r} is also {seen[a.name]}'s "
                                     "name; adapter names must be unique in the app")
                seen[a.name] = where
                unknown = sorted(set(a.owners) - tenants - {PUBLIC})
                if unknown:
                    raise ValueError(
                        f"{where}.owners: {unknown} are not configured tenants; list tenants "
                        f"of `tenants:` or `{PUBLIC}`")

    def adapter_owner(self, name: str) -> tuple[ModelSettings, AdapterSettings] | None:
        """The model serving adapter ``name`` and the adapter's settings, or None."""
        return next(((m, a) for m in self.models for a in m.adapters if a.name == name), None)

    def model(self, name: str) -> ModelSettings | None:
        """The model served under ``name``, or None."""
        return next((m for m in self.models if m.name == name), None)


class ConfigError(ValueError):
    """A config that cannot be served; the message names the field and the fix."""


def _format_validation_error(source: str, err: ValidationError) -> str:
    lines = [f"{source}: invalid deployment config"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field; check its spelling against serve_app/config/"
        if not loc and re.match(r"[a-z_]+\.\d+\.", msg):  # a whole-config check names it
            lines.append(f"  {msg}")
            continue
        lines.append(f"  {loc or '(top level)'}: {msg}")
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
        check_adapter_folders(cfg, source)
        return cfg
    models = []
    for m in cfg.models:
        p = Path(m.path)
        if not p.is_absolute() and (m.path.startswith(".") or (base_dir / p).exists()):
            m = m.model_copy(update={"path": str((base_dir / p).resolve())})
        models.append(m.model_copy(update={"adapters": [
            a.model_copy(update={"path": _local_path(a.path, base_dir)}) for a in m.adapters]}))
    cfg = cfg.model_copy(update={"models": models})
    check_adapter_folders(cfg, source)
    return cfg


def _local_path(path: str, base_dir: Path) -> str:
    """``path`` made absolute if it names a local folder (as a model's path resolves)."""
    p = Path(path)
    if not p.is_absolute() and (path.startswith(".") or (base_dir / p).exists()):
        return str((base_dir / p).resolve())
    return path


def check_adapter_folders(cfg: AppConfig, source: str = "<config>") -> None:
    """Every local adapter folder (an absolute path: :func:`parse_config` resolves relative
    ones) holds a LoRA adapter_config.json whose rank fits its model's ``lora.max_lora_rank``.
    Hub ids are left to vLLM (loaded when first asked for). Raises :class:`ConfigError`
    naming the field (``models.0.adapters.1.path``, as every config error does)."""
    problems = []
    for i, m in enumerate(cfg.models):
        for j, a in enumerate(m.adapters):
            if not Path(a.path).is_absolute():
                continue
            where = f"models.{i}.adapters.{j}.path"
            try:
                rank = read_adapter_config(Path(a.path))["r"]
            except ValueError as err:
                problems.append(f"  {where}: {err}")
                continue
            limit = m.lora.max_lora_rank if m.lora is not None else 0
            if rank > limit:
                problems.append(f"  {where}: the adapter's rank {rank} is above "
                                f"models.{i}.lora.max_lora_rank ({limit}); raise it (a "
                                "restart of the model's engines) or use a smaller adapter")
    if problems:
        raise ConfigError("\n".join([f"{source}: invalid deployment config", *problems]))


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

