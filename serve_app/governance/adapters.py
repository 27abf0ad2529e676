"""The router's adapter table: which LoRA adapter ids exist, on which base model, and which
tenant may use each.

An adapter is served as a model id of its own. For a tenant allowed to use it (an owner, or
any tenant for a ``public`` one, and only where the tenant may use the base model) a request
naming it goes to the base model's engines with the adapter (:meth:`AdapterTable.route`) and
counts as that tenant's, against its limits. For every other tenant it does not exist: the
same 404 ``model_not_found`` as an unknown model, never a 403 that would tell it the adapter
is there. The table follows the live config (:class:`serve_app.governance.live_config.
LiveTenants` rebuilds it when a deploy publishes new adapters): nothing restarts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from serve_app.config import AppConfig, adapter_id
from serve_app.governance.keys import Tenant


class _Named(Protocol):
    """What :meth:`AdapterTable.route` reads and writes of a request: its ``model``."""

    model: str


@dataclass(frozen=True, slots=True)
class ServedAdapter:
    """One adapter as the routers serve it. ``ref`` is what a request carries to the engine
    (:attr:`serve_app.engine.protocol.GenerationRequest.adapter`)."""

    name: str
    model: str
    ref: tuple[str, int, str]
    owners: frozenset[str]
    public: bool

    def allowed(self, tenant: Tenant) -> bool:
        """Whether ``tenant`` may use (and see) this adapter."""
        return (self.public or tenant.name in self.owners) and tenant.may_use(self.model)


class AdapterTable:
    """Adapter id -> :class:`ServedAdapter`, for the models of one app config. Immutable;
    a live change builds a new one."""

    def __init__(self, adapters: list[ServedAdapter]) -> None:
        self._by_name = {a.name: a for a in adapters}

    @classmethod
    def from_config(cls, config: AppConfig) -> AdapterTable:
        return cls([ServedAdapter(a.name, m.name, (a.name, adapter_id(m.name, a.name, a.path),
                                                   a.path), frozenset(a.owners), a.public)
                    for m in config.models for a in m.adapters])

    def __len__(self) -> int:
        return len(self._by_name)

    def for_tenant(self, name: str, tenant: Tenant) -> ServedAdapter | None:
        """The adapter ``name`` if ``tenant`` may use it; None if unknown or not allowed (the
        caller answers both alike)."""
        adapter = self._by_name.get(name)
        return adapter if adapter is not None and adapter.allowed(tenant) else None

    def visible(self, tenant: Tenant) -> list[ServedAdapter]:
        """The adapters ``tenant`` may use, in config order."""
        return [a for a in self._by_name.values() if a.allowed(tenant)]

    def route(self, request: _Named, tenant: Tenant) -> tuple[str, int, str] | None:
        """For a request naming an adapter ``tenant`` may use: point ``request.model`` at the
        base model (admission, engines and metrics are the base model's) and return the
        adapter's ref. Otherwise leave the request alone and return None: an unknown name and
        another tenant's adapter then meet the same 404 as an unknown model."""
        adapter = self.for_tenant(request.model, tenant)
        if adapter is None:
            return None
        request.model = adapter.model
        return adapter.ref

    def card(self, adapter: ServedAdapter, base: dict[str, Any]) -> dict[str, Any]:
        """``adapter``'s /v1/models card from its base model's ``base`` card: the adapter's id,
        ``parent`` the base model (as vLLM lists its adapters), the base's context length. No
        path: where an adapter lives on the servers is not the tenant's business."""
        return {**base, "id": adapter.name, "root": adapter.name, "parent": adapter.model}
