"""Tenancy: API keys -> tenant, per-tenant quotas. Pure Python (no Ray), unit-tested alone."""
