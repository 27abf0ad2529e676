"""The router's tenant gate: who is asking (API key -> tenant), may they use this model, are they
within their quota (and their budget's reservation); the tenant's token charges as they flow,
and its metrics once a request ends. What one request owes, and when each of these is called,
is :mod:`serve_app.governance.accounting`'s business.

Pure decisions live in :mod:`serve_app.governance`; this module turns them into OpenAI errors and
Ray metrics.
"""

from __future__ import annotations

import math
import time
from typing import Any, Sequence

from ray.serve.metrics import Counter, Gauge, Histogram

from serve_app.config import AppConfig, TenantSettings
from serve_app.admission.controller import AdmissionController
from serve_app.engine.protocol import EngineLoad
from serve_app.governance.cluster_quota import ClusterQuota
from serve_app.governance.cluster_slots import ClusterSlots
from serve_app.ingress.errors import OpenAIError
from serve_app.observability.metrics import (
    LATENCY_BUCKETS_S,
    METRICS,
    ROUTER_METRICS,
    exported_name,
)
from serve_app.governance.budget import BudgetBook
from serve_app.governance.concurrency import ConcurrencyCaps
from serve_app.governance.fair_queue import BANDS
from serve_app.governance.headers import ratelimit_headers
from serve_app.governance.keys import KeyRing, Tenant
from serve_app.governance.quota import Admission, QuotaBook


def _metric(cls: type, key: str, kind: str, tags: tuple[str, ...], **kwargs: object) -> Any:
    """Register router metric ``key`` with Ray; its name and help come from the metric table."""
    name = ROUTER_METRICS[key]
    exported = exported_name(name, kind)
    assert exported in METRICS, name  # one table for every metric name
    return cls(name, description=METRICS[exported].help, tag_keys=tags, **kwargs)


class TenantGate:
    """Authentication, model access and quotas for one router replica."""

    def __init__(self, config: AppConfig, app_name: str | None = None) -> None:
        """With ``app_name`` and ``governance.quota_scope: cluster``, rates are enforced for
        the whole app through its quota actor (:mod:`serve_app.governance.cluster_quota`), this
        replica's share in :attr:`quotas` being the fallback; else by :attr:`quotas` alone."""
        self.keys = KeyRing(config.tenants)
        self.quotas = QuotaBook(config.tenants, share=1 / config.router.num_replicas)
        self.cluster = (ClusterQuota(app_name, config.tenants, config.router.num_replicas,
                                     self.quotas)
                        if app_name is not None and config.governance.quota_scope == "cluster"
                        else None)
        # Shared by every model's admission controller of this replica (the cap spans models);
        # with the cluster quota and several replicas, its slots are leased from the quota
        # actor by demand (one replica's share is the whole cap: nothing to lease).
        self.caps = ConcurrencyCaps(
            config.tenants, share=1 / config.router.num_replicas,
            slots=ClusterSlots(self.cluster.link)
            if self.cluster is not None and config.router.num_replicas > 1 else None)
        # Budgets are whole per tenant (not shared out): every replica sums all the records;
        # each replica holds its reservations to its part of what is left (budget.py).
        self.budgets = BudgetBook(config.tenants, routers=config.router.num_replicas)
        self._requests = _metric(Counter, "tenant_requests", "counter",
                                 ("tenant", "model", "status", "adapter"))
        self._tokens = _metric(Counter, "tenant_tokens", "counter",
                               ("tenant", "model", "kind", "adapter"))
        self._queued = _metric(Gauge, "router_queued", "gauge", ("model", "priority"))
        self._ttft = _metric(Histogram, "tenant_ttft", "histogram", ("tenant", "model"),
                             boundaries=LATENCY_BUCKETS_S)
        self._queue_wait = _metric(Histogram, "tenant_queue_wait", "histogram",
                                   ("tenant", "model"), boundaries=LATENCY_BUCKETS_S)
        self._capacity = _metric(Gauge, "admission_capacity", "gauge", ("model",))
        self._live = _metric(Gauge, "live_replicas", "gauge", ("model",))
        self._demand = _metric(Gauge, "demand", "gauge", ("model",))
        self._target = _metric(Gauge, "target_per_replica", "gauge", ("model",))
        self._targets = {m.name: m.target_per_replica for m in config.models}
        self._queued_now: dict[str, int] = {}
        self._queued_bands: dict[str, dict[str, int]] = {}

    def set_tenants(self, tenants: list[TenantSettings]) -> None:
        """A live tenant change: keys, priorities, model access and limits from now on
        (requests already admitted finish as they were admitted)."""
        self.keys = KeyRing(tenants)
        self.quotas.update(tenants)
        if self.cluster is not None:
            self.cluster.update(tenants)
        self.caps.update(tenants)
        self.budgets.update(tenants)

    def admitted(self, tenant: Tenant, model: str, waited_s: float) -> None:
        """A request left the router's queue (or passed straight through) after ``waited_s``."""
        self._queue_wait.observe(waited_s, tags={"tenant": tenant.name, "model": model})

    def first_token(self, tenant: Tenant, model: str, ttft_s: float) -> None:
        self._ttft.observe(ttft_s, tags={"tenant": tenant.name, "model": model})

    def queue_changed(self, model: str, admission: AdmissionController) -> None:
        """Publish ``model``'s router queue depth per priority band."""
        self._queued_bands[model] = {band: admission.queued(band) for band in BANDS}
        self._publish_queue(model)
        self._queued_now[model] = admission.queued()

    def _publish_queue(self, model: str) -> None:
        for band, n in self._queued_bands.get(model, {}).items():
            self._queued.set(n, tags={"model": model, "priority": band})

    def engines_polled(self, model: str, replicas: Sequence[EngineLoad], capacity: int) -> None:
        """Publish what the engine feed of ``model`` saw: capacity, live replicas, demand."""
        tags = {"model": model}
        self._capacity.set(capacity, tags=tags)
        self._live.set(len(replicas), tags=tags)
        in_engines = sum(r.in_engine for r in replicas)
        self._demand.set(in_engines + self._queued_now.get(model, 0), tags=tags)
        self._target.set(self._targets.get(model, 0), tags=tags)
        # Re-record the queue depth too: a gauge left unrecorded while requests pass straight
        # through drops out of Ray's export after a while (seen: the queue panel went blank).
        self._publish_queue(model)

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant of an ``Authorization`` header, or a 401 (the key is never echoed)."""
        tenant = self.keys.resolve(authorization)
        if tenant is None:
            self._requests.inc(tags={"tenant": "unauthenticated", "model": "", "status": "401",
                                     "adapter": ""})
            msg = ("Incorrect API key provided." if authorization else
                   "Missing API key: send `Authorization: Bearer <key>`.")
            raise OpenAIError(401, msg, code="invalid_api_key")
        return tenant

    async def acquire(self, tenant: Tenant, reserve_tokens: int = 0) -> int:
        """:meth:`admit`, with the rates of the whole app when the quota is cluster-wide (a
        call to the quota actor only when this replica's lease of the tenant runs out).
        Returns the budget tokens held for the request (see :meth:`admit`)."""
        if self.cluster is None:
            return self.admit(tenant, reserve_tokens)
        held = self._reserve(tenant, reserve_tokens)
        try:
            self._refuse(await self.cluster.admit(tenant.name))
        except BaseException:  # refused by a rate (or cancelled): nothing stays reserved
            self.budgets.release(tenant.name, held)
            raise
        return held

    def admit(self, tenant: Tenant, reserve_tokens: int = 0) -> int:
        """Raise 429 with ``Retry-After`` when the tenant is over a quota (``insufficient_quota``
        once its token budget is used up by its spend and its requests in flight,
        ``rate_limit_exceeded`` over a rate) by this replica's own buckets; else admit, holding
        ``reserve_tokens`` of its budget, and return what is held (0 without a budget: give it
        back through :meth:`charge_tokens` or :meth:`refund`)."""
        held = self._reserve(tenant, reserve_tokens)
        decision = self.quotas.admit(tenant.name)
        if not decision.admitted:
            self.budgets.release(tenant.name, held)
            self._refuse(decision)
        return held

    def _reserve(self, tenant: Tenant, tokens: int) -> int:
        """Check the budget and hold ``tokens`` of it, with no await between the two."""
        spent = self.budgets.check(tenant.name, tokens)
        if spent is not None:
            wait = spent.retry_after_s(time.time())
            raise OpenAIError(429, spent.message, code="insufficient_quota",
                              error_type="insufficient_quota",
                              headers={"Retry-After": str(max(1, math.ceil(wait))),
                                       "x-ratelimit-limit-type": "token_budget"})
        return self.budgets.reserve(tenant.name, tokens)

    @staticmethod
    def _refuse(decision: Admission) -> None:
        if not decision.admitted:
            wait = max(decision.retry_after_s, 0.001)
            raise OpenAIError(
                429, decision.message, code="rate_limit_exceeded",
                headers={"Retry-After": str(math.ceil(wait)),
                         "retry-after-ms": str(math.ceil(wait * 1000)),
                         "x-ratelimit-limit-type": decision.limit or ""})

    def ratelimit_headers(self, tenant: Tenant, pending_tokens: int = 0) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers for ``tenant`` now (none for a limit it does not
        have); ``pending_tokens``: the tokens of the request being answered, not yet settled.
        The limits are the tenant's whole limits in every quota scope and during a quota
        outage; ``remaining`` is what the replica enforcing it now knows (the cluster quota's
        view, else this replica's share scaled to the limit: :mod:`serve_app.governance.headers`)."""
        state = (self.cluster.state(tenant.name, pending_tokens)
                 if self.cluster is not None else None)
        return ratelimit_headers(*(state or self.quotas.state(tenant.name, pending_tokens)))

    def refund(self, tenant: Tenant, held: int = 0) -> None:
        """Undo :meth:`admit` (the request was refused with queue_full): its request charge
        and the ``held`` budget tokens go back."""
        self.budgets.release(tenant.name, held)
        if self.cluster is not None:
            self.cluster.refund(tenant.name)
        else:
            self.quotas.refund(tenant.name)

    def charge_tokens(self, tenant: Tenant, tokens: int, release: int = 0) -> None:
        """``tenant``'s request used ``tokens`` more (prompt or completion, as they flow): its
        token quota and budget pay them; ``release``: budget tokens that request held and gives
        back now (what it just charged, or at its end what it did not use)."""
        if tokens > 0:
            name = tenant.name
            self.quotas.settle(name, tokens)
            if self.cluster is not None:
                self.cluster.settle(name, tokens)
            self.budgets.charge(name, tokens)
        if release > 0:
            self.budgets.release(tenant.name, release)

    def finish(self, tenant: Tenant, model: str, status: int, prompt_tokens: int = 0,
               completion_tokens: int = 0, adapter: str = "") -> None:
        """Count one ended request in the tenant metrics: its status and tokens (the quota and
        the budget were charged as the tokens flowed: :meth:`charge_tokens`); ``adapter``: the
        LoRA adapter it ran with on ``model`` ("" for the base model)."""
        tags = {"tenant": tenant.name, "model": model, "adapter": adapter}
        self._requests.inc(tags={**tags, "status": str(status)})
        if prompt_tokens:
            self._tokens.inc(prompt_tokens, tags={**tags, "kind": "prompt"})
        if completion_tokens:
            self._tokens.inc(completion_tokens, tags={**tags, "kind": "completion"})
