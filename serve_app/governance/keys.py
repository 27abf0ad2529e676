"""API keys -> tenants. Only SHA-256 digests of keys are held; a key is never stored or logged.

Lookup hashes the presented key and finds the digest in a dict. The only secret-dependent work is
on the SHA-256 output, which a client cannot steer toward a stored digest, so the lookup leaks
nothing usable about stored keys (the timing attack on a plain string compare, vLLM's
CVE-2025-59425, needs the compared value to be the secret itself).
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from serve_app.config import Priority, TenantSettings

ANONYMOUS = "anonymous"
KEY_PREFIX = "sk-sa-"


def key_digest(key: str) -> str:
    """The SHA-256 hex digest the config stores for ``key``."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    """A fresh API key: 256 random bits, URL-safe."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who a request acts for, as the router sees it."""

    name: str
    priority: Priority = "normal"
    models: frozenset[str] | None = None  # None: every model

    @property
    def cache_salt(self) -> str:
        """Per-tenant prefix-cache salt (CVE-2025-46570): tenants never share cached prefixes,
        so one cannot learn another's prompts from timing. Derived here, never from the client."""
        return hashlib.sha256(f"serve-app-tenant:{self.name}".encode()).hexdigest()[:32]

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


class KeyRing:
    """Resolves ``Authorization`` headers to tenants. With no tenants configured the endpoint is
    open and every request is the ``anonymous`` tenant."""

    def __init__(self, tenants: list[TenantSettings]) -> None:
        self._by_digest: dict[str, Tenant] = {}
        for t in tenants:
            tenant = Tenant(t.name, t.priority, None if t.models is None else frozenset(t.models))
            for d in t.api_key_sha256:
                self._by_digest[d] = tenant
        self.open = not tenants
        self._anonymous = Tenant(ANONYMOUS)

    def resolve(self, authorization: str | None) -> Tenant | None:
        """The tenant a ``Bearer`` key belongs to; None when the key is missing or unknown."""
        if self.open:
            return self._anonymous
        if not authorization:
            return None
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        return self._by_digest.get(key_digest(key.strip()))
