"""The governance section: the per-request usage record (billing) and where it is written."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from serve_app.config.base import _Strict


class UsageSettings(_Strict):
    """One JSON line per finished request (serve_app/governance/usage.py), through Python
    logging to a rotating file per router replica; `serve-app usage` sums them."""

    dir: str | None = Field(
        None, description="Folder of the usage files, on the node of each router replica "
        "(each writes `usage-<replica>.jsonl`, rotated to `.1`, `.2`, ...). A relative path is "
        "made absolute where the config is loaded (`serve-app deploy`'s working directory). "
        "None: no file.")
    stdout: bool = Field(
        False, description="Also write each line to the router replica's stdout (a log "
        "collector reading the replicas' output).")
    max_bytes: int = Field(
        100 * 1024 * 1024, ge=1024, description="Size at which a usage file is rotated.")
    backups: int = Field(
        20, ge=0, description="Rotated usage files kept per router replica (older ones are "
        "deleted: move them off to keep them).")

    @field_validator("dir")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        # The router replica's working directory is Ray's, not the deployer's: a relative folder
        # would land somewhere under Ray's session directory.
        return None if v is None else str(Path(v).expanduser().resolve())

    @property
    def enabled(self) -> bool:
        return self.dir is not None or self.stdout


class GovernanceSettings(_Strict):
    """Billing and audit of tenants (issue 29)."""

    usage: UsageSettings = Field(default_factory=UsageSettings)
    audit_retention_days: float = Field(
        365, gt=0, description="How long the audit trail keeps a record of a change of tenants "
        "or config (one record per deploy, in the cluster's key-value store; "
        "serve_app/governance/audit.py). Older records are removed at the next deploy.")
    quota_scope: Literal["cluster", "replica"] = Field(
        "cluster", description="`cluster`: one quota state for the app (a Ray actor), so "
        "every router replica enforces a tenant's whole requests_per_minute and "
        "tokens_per_minute together, and a router restart refills nothing; routers take "
        "leases of it in batches and fall back to their own share with a warning when it "
        "does not answer (serve_app/governance/cluster_quota.py). `replica`: each router replica "
        "holds its share (1/num_replicas) of every limit on its own.")
