"""Governance: every tenant limit and record, in one package.

- Pure logic (no Ray, unit-tested alone): ``keys`` (API keys -> tenant), ``quota`` (RPM/TPM
  windows), ``budget`` (token budgets per UTC day/month), ``concurrency`` (caps and slot tables),
  ``fair_queue`` (bands and per-tenant fair share), ``headers`` (rate-limit headers),
  ``accounting`` (reserve at admission, charge as tokens flow, settle at the end).
- The governor: ``quota_state`` (the per-app quota actor: buckets, slot leases, checkpoints),
  ``cluster_quota`` (a router's client of it: leases spent locally), ``cluster_slots``
  (cluster-wide caps leased by demand), ``fair_share_sync`` (fair-share service shared by the
  routers on the report they already send), ``quota_link`` (the one failure rule for calls to
  the actor), ``budgets``
  (the budget records in Ray's KV), ``live_config`` (the versioned tenant list every deploy
  path writes).
- The router's side: ``tenants`` (the tenant gate every request passes).
- Records: ``usage`` (per-request usage files), ``audit`` (the append-only change trail).
"""
