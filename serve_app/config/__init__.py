"""One pydantic schema for a whole deployment, loaded from YAML under ``deployments/``.

A wrong config fails at load time (:func:`load_config`) with a message that names the field and
says what to change; nothing is discovered half-way through starting replicas. The schema is
split by section: :mod:`.model` (a served model and its autoscaling), :mod:`.lora` (its LoRA limits and adapters), :mod:`.router` (the
router, admission), :mod:`.app` (tenants, the whole deployment, loading), :mod:`.base`
(constants); every name is importable from ``serve_app.config``.
"""

from serve_app.config.app import (
    TENANTS_FILE_ENV,
    AppConfig,
    ConfigError,
    Priority,
    TenantSettings,
    TokenBudget,
    load_config,
    parse_config,
    tenants_from_file,
)
from serve_app.config.base import (
    APP_NAME,
    DEFAULT_CONFIG,
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_MODEL_NAME,
    DEFAULT_STALL_TIMEOUT_S,
    LOOPBACK_HOSTS,
    VLLM_DEFAULT_MAX_NUM_SEQS,
)
from serve_app.config.governance import GovernanceSettings, UsageSettings
from serve_app.config.observability import TracingSettings
from serve_app.config.lora import PUBLIC, AdapterSettings, LoraSettings, adapter_id
from serve_app.config.model import AutoscalingSettings, ModelSettings
from serve_app.config.router import AdmissionSettings, RouterSettings

__all__ = ["PUBLIC", "AdapterSettings", "LoraSettings", "adapter_id", "APP_NAME", "DEFAULT_CONFIG", "DEFAULT_DRAIN_TIMEOUT_S", "DEFAULT_MODEL_NAME",
           "DEFAULT_STALL_TIMEOUT_S", "LOOPBACK_HOSTS", "TENANTS_FILE_ENV",
           "VLLM_DEFAULT_MAX_NUM_SEQS", "AdmissionSettings", "AppConfig", "AutoscalingSettings",
           "ConfigError", "GovernanceSettings", "ModelSettings", "Priority", "RouterSettings",
           "TenantSettings", "TokenBudget", "TracingSettings", "UsageSettings", "load_config",
           "parse_config",
           "tenants_from_file"]
