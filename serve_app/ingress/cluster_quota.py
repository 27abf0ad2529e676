"""One quota state per cluster: every router replica enforces a tenant's whole RPM and TPM
together, through one Ray actor, with leases so the hot path makes no remote call per request.

**The actor** (:class:`QuotaState`, one per app, detached, named ``<app>-quota``) holds each
tenant's request and token buckets at their full size (a :class:`QuotaBook` of share 1 on the
wall clock). It follows the live tenant list in the cluster's key-value store (the same record
the routers follow), and checkpoints its buckets there at most every ``CHECKPOINT_S``; an actor
that is lost and started again (Ray restarts it) restores them, refilled for the time passed.

**Router replicas** (:class:`ClusterQuota`) take request tokens in leases: one call takes about a
second's worth of the tenant's rate divided among the routers (at least one), and requests
are then admitted from the lease locally. Unused leases go back after ``LEASE_TTL_S``. Token
usage (charged when requests end) is reported in batches every ``FLUSH_S``, and each answer
carries the tenant's token level, which admission checks locally, less what this replica
charged since. A replica that restarts starts with no lease: the actor's buckets are where they
were, so a restart does not refill anyone.

**Error bound** with N router replicas: requests never pass the limit (a lease is taken out of
the bucket before it is used; an unused lease is capacity held back for at most
``LEASE_TTL_S``, and lost with a replica that dies holding it). Tokens can pass the limit by
what the tenant has in flight plus what the other replicas charged within the last
``FLUSH_S`` (each replica sees its own charges at once), as with one replica plus that window.
If the actor cannot be reached within ``CALL_TIMEOUT_S``, the replica falls back to its local
share (1/N of every limit, the replica's own buckets) with a warning, and tries the actor again
after ``RETRY_S``; the routers' charges made meanwhile are reported when it answers again. The
share starts from the actor's last word, not full: each tenant this replica has seen gets 1/N
of what the actor said was left (refilled to now), plus its unused lease, less its unreported
usage, so losing the actor refills nobody. A tenant the replica had not seen starts its share
full: during an outage, a tenant can pass its limit by the shares of the replicas that had not
served it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from serve_app.config import TenantSettings
from serve_app.tenancy.headers import LimitState
from serve_app.tenancy.quota import ADMITTED, Admission, QuotaBook

logger = logging.getLogger(__name__)

NAMESPACE = "serve_app"
CALL_TIMEOUT_S = 1.0
# A replica's first call waits longer: it may create the actor, whose worker process takes
# seconds to start on a loaded host (with 1 s every router fell back to its share at start).
STARTUP_TIMEOUT_S = 30.0
RETRY_S = 5.0
FLUSH_S = 0.25
LEASE_WINDOW_S = 1.0
LEASE_TTL_S = 2.0
CHECKPOINT_S = 1.0
TENANTS_REFRESH_S = 1.0
# A tenant this replica served within this long has its buckets re-read at every flush; an
# older view is re-read before the tenant's next request is admitted on it.
ACTIVE_S = 5.0


def actor_name(app_name: str) -> str:
    return f"{app_name}-quota"


def _checkpoint_key(app_name: str) -> str:
    return f"{app_name}/quota/checkpoint"


def _snapshot(book: QuotaBook, tenant: str) -> dict[str, Any]:
    """The tenant's buckets as the routers need them: [capacity, level, rate] or None."""
    now = book.clock()
    out: dict[str, Any] = {}
    for kind, buckets in (("rpm", book._rpm), ("tpm", book._tpm)):
        b = buckets.get(tenant)
        if b is None:
            out[kind] = None
        else:
            b.wait_for(0, now)  # refill to now
            out[kind] = [b.capacity, b.level, b.rate]
    return out


class QuotaState:
    """The cluster's quota state (run as a Ray actor; see the module docstring). Methods are
    called by router replicas; each applies the caller's token ``charges`` and unused lease
    ``returns`` first."""

    def __init__(self, app_name: str, tenants: list[dict[str, Any]]) -> None:
        self.app_name = app_name
        self.book = QuotaBook([TenantSettings.model_validate(t) for t in tenants],
                              clock=time.time)
        self.version: str | None = None
        self._tenants_read = 0.0
        self._checkpointed = 0.0
        self._restore: dict[str, Any] | None = self._read_checkpoint()
        self._refresh_tenants(force=True)

    # -- persistence ----------------------------------------------------------------------------
    def _read_checkpoint(self) -> dict[str, Any] | None:
        from serve_app.serve_private import kv_get

        try:
            raw = kv_get(_checkpoint_key(self.app_name))
            return json.loads(raw) if raw else None
        except Exception:
            logger.exception("quota checkpoint unreadable; starting with full buckets")
            return None

    def _apply_checkpoint(self) -> None:
        """Put the checkpointed levels back into buckets whose limits are unchanged (they
        refill for the time since, as they would have)."""
        if not self._restore:
            return
        for kind, buckets in (("rpm", self.book._rpm), ("tpm", self.book._tpm)):
            for tenant, (capacity, level, updated) in self._restore.get(kind, {}).items():
                b = buckets.get(tenant)
                if b is not None and math.isclose(b.capacity, capacity):
                    b.level, b.updated = level, updated
        self._restore = None

    def _checkpoint(self) -> None:
        now = time.time()
        if now - self._checkpointed < CHECKPOINT_S:
            return
        self._checkpointed = now
        from serve_app.serve_private import kv_put

        state = {kind: {t: [b.capacity, b.level, b.updated] for t, b in buckets.items()}
                 for kind, buckets in (("rpm", self.book._rpm), ("tpm", self.book._tpm))}
        try:
            kv_put(_checkpoint_key(self.app_name), json.dumps(state).encode())
        except Exception:
            logger.exception("quota checkpoint failed")

    def _refresh_tenants(self, force: bool = False) -> None:
        """Follow the live tenant list (the record `serve-app deploy` publishes)."""
        now = time.time()
        if not force and now - self._tenants_read < TENANTS_REFRESH_S:
            return
        self._tenants_read = now
        try:
            from serve_app.ingress.live_config import read_tenants

            live = read_tenants(self.app_name)
        except Exception:
            logger.exception("live tenant list unreadable; keeping the current limits")
            live = None
        if live is not None and live[0] != self.version:
            self.version = live[0]
            self.book.update(live[1])
        self._apply_checkpoint()

    # -- the routers' calls --------------------------------------------------------------------
    def _apply(self, charges: dict[str, int], returns: dict[str, int]) -> None:
        self._refresh_tenants()
        for tenant, tokens in charges.items():
            self.book.settle(tenant, tokens)
        for tenant, unused in returns.items():
            for _ in range(unused):
                self.book.refund(tenant)
            bucket = self.book._rpm.get(tenant)
            if bucket is not None:  # a lease given back never lifts a bucket past full
                bucket.level = min(bucket.level, bucket.capacity)

    def lease(self, tenant: str, want: int, charges: dict[str, int],
              returns: dict[str, int]) -> dict[str, Any]:
        """Take up to ``want`` requests of ``tenant`` (at least one if any is free): the answer
        says how many were ``granted``; with none, ``retry_after_s``, ``limit`` and
        ``message`` of the refusal; and ``snapshot``, the buckets of ``tenant`` and of every
        tenant charged, after it."""
        self._apply(charges, returns)
        granted, refusal = 0, ADMITTED
        while granted < want:
            decision = self.book.admit(tenant)
            if not decision.admitted:
                refusal = decision
                break
            granted += 1
        self._checkpoint()
        return {"granted": granted, "retry_after_s": refusal.retry_after_s,
                "limit": refusal.limit, "message": refusal.message,
                "snapshot": {t: _snapshot(self.book, t) for t in {tenant, *charges}}}

    def report(self, charges: dict[str, int], returns: dict[str, int],
               tenants: list[str]) -> dict[str, Any]:
        """Apply a replica's charges and returns; the buckets of ``tenants`` after them."""
        self._apply(charges, returns)
        self._checkpoint()
        return {t: _snapshot(self.book, t) for t in tenants}


@dataclass
class _Lease:
    """One tenant as this replica knows it: leased requests not used yet, token usage not
    reported yet, and the actor's last word on its buckets (with when it was read)."""

    requests: int = 0
    granted_at: float = 0.0
    unflushed: int = 0
    sending: int = 0                 # reported, the answer not back yet: still counted here
    rpm: list[float] | None = None   # [capacity, level, rate] at ``seen``
    tpm: list[float] | None = None
    seen: float = 0.0
    used: float = 0.0                # when this replica last admitted a request of it


class ClusterQuota:
    """A router replica's side of the cluster quota (see the module docstring); ``local`` is
    the replica's own :class:`QuotaBook` (its share), used while the actor is unreachable.
    Single-threaded (the router's event loop)."""

    def __init__(self, app_name: str, tenants: list[TenantSettings], routers: int,
                 local: QuotaBook) -> None:
        self.app_name = app_name
        self.routers = routers
        self.local = local
        self._limits = {t.name: t for t in tenants}
        self._leases: dict[str, _Lease] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._actor: Any = None
        self._down_until = 0.0
        self._answered = False  # the actor answered this replica at least once
        self._shares_seeded = False  # the local shares were set from the actor's last word
        self._flusher: asyncio.Task[None] | None = None

    def update(self, tenants: list[TenantSettings]) -> None:
        """A new live tenant list: a tenant whose limits changed starts a fresh lease."""
        old, self._limits = self._limits, {t.name: t for t in tenants}
        for name in list(self._leases):
            a, b = old.get(name), self._limits.get(name)
            if b is None or a is None or (a.requests_per_minute, a.tokens_per_minute) != (
                    b.requests_per_minute, b.tokens_per_minute):
                self._leases.pop(name)

    @property
    def degraded(self) -> bool:
        """Whether this replica enforces its local share now (the actor did not answer)."""
        return time.monotonic() < self._down_until

    def _limited(self, tenant: str) -> TenantSettings | None:
        t = self._limits.get(tenant)
        return t if t is not None and (t.requests_per_minute or t.tokens_per_minute) else None

    # -- the actor ------------------------------------------------------------------------------
    async def _call(self, method: str, *args: Any) -> Any:
        """``method`` on the actor within CALL_TIMEOUT_S (STARTUP_TIMEOUT_S until it first
        answered this replica); on failure the replica falls back to its local share for
        RETRY_S and the error is raised."""
        try:
            if self._actor is None:
                self._actor = await asyncio.to_thread(self._get_actor)
            answer = await asyncio.wait_for(
                getattr(self._actor, method).remote(*args),
                CALL_TIMEOUT_S if self._answered else STARTUP_TIMEOUT_S)
            self._answered = True
            self._shares_seeded = False
            return answer
        except Exception:
            if not self.degraded:
                logger.warning("the cluster quota state did not answer; enforcing this router "
                               "replica's share (1/%d) of every limit for %g s", self.routers,
                               RETRY_S, exc_info=True)
            if not self._shares_seeded:  # once per outage: later, the shares are the truth
                self._seed_local_shares()
                self._shares_seeded = True
            self._actor = None
            self._down_until = time.monotonic() + RETRY_S
            raise

    def _seed_local_shares(self) -> None:
        """Set the local share of every tenant the actor told this replica about to 1/N of
        what it said was left (refilled to now), plus this replica's unused lease, less its
        unreported usage (see the module docstring)."""
        for tenant, lease in self._leases.items():
            if not lease.seen:
                continue
            requests = self._level(lease.rpm, lease.seen)
            tokens = self._level(lease.tpm, lease.seen)
            self.local.seed(
                tenant,
                None if requests is None else requests / self.routers + lease.requests,
                None if tokens is None
                else tokens / self.routers - lease.unflushed - lease.sending)
            lease.requests = 0  # moved into the share: not used or given back twice

    def _get_actor(self) -> Any:
        import ray

        tenants = [t.model_dump(mode="json") for t in self._limits.values()]
        return ray.remote(QuotaState).options(
            name=actor_name(self.app_name), namespace=NAMESPACE, get_if_exists=True,
            lifetime="detached", num_cpus=0, max_restarts=-1).remote(self.app_name, tenants)

    def _take_unreported(self) -> tuple[dict[str, int], dict[str, int]]:
        """Charges not reported yet (now being sent: they still count here until the answer,
        which includes them, is seen), and leases past their TTL (given back)."""
        now = time.monotonic()
        charges, returns = {}, {}
        for tenant, lease in self._leases.items():
            if lease.unflushed:
                charges[tenant], lease.unflushed = lease.unflushed, 0
                lease.sending += charges[tenant]
            if lease.requests and now - lease.granted_at > LEASE_TTL_S:
                returns[tenant], lease.requests = lease.requests, 0
        return charges, returns

    def _reported(self, charges: dict[str, int], ok: bool) -> None:
        """The call that carried ``charges`` ended: its answer holds them, or (not ``ok``) they
        wait for the next one. Call after the answer's snapshot was seen."""
        for tenant, tokens in charges.items():
            lease = self._leases.setdefault(tenant, _Lease())
            lease.sending -= tokens
            if not ok:
                lease.unflushed += tokens

    def _seen(self, snapshot: dict[str, Any]) -> None:
        now = time.monotonic()
        for tenant, buckets in snapshot.items():
            lease = self._leases.setdefault(tenant, _Lease())
            lease.rpm, lease.tpm, lease.seen = buckets["rpm"], buckets["tpm"], now

    async def _flush_forever(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_S)
            if self.degraded:
                continue
            charges, returns = self._take_unreported()
            now = time.monotonic()
            tenants = [t for t, lease in self._leases.items() if self._limited(t)
                       and (now - lease.used < ACTIVE_S or t in charges)]
            if not (charges or returns or tenants):
                continue
            try:
                self._seen(await self._call("report", charges, returns, tenants))
            except Exception:
                self._reported(charges, ok=False)  # reported when the actor answers again
            else:
                self._reported(charges, ok=True)

    # -- the gate's calls ----------------------------------------------------------------------
    async def admit(self, tenant: str) -> Admission:
        """Admit one request of ``tenant`` (from its lease, else a new one) or refuse it with
        the wait after which a retry can succeed."""
        limits = self._limited(tenant)
        if limits is None:
            return ADMITTED
        if self._flusher is None:
            self._flusher = asyncio.get_running_loop().create_task(self._flush_forever())
        if self.degraded:
            return self.local.admit(tenant)
        lease = self._leases.setdefault(tenant, _Lease())
        lease.used = time.monotonic()
        if self._fits(lease, limits):
            lease.requests -= bool(limits.requests_per_minute)
            return ADMITTED
        lock = self._locks.setdefault(tenant, asyncio.Lock())
        async with lock:
            lease = self._leases.setdefault(tenant, _Lease())
            if self._fits(lease, limits):  # another request's lease call brought enough
                lease.requests -= bool(limits.requests_per_minute)
                return ADMITTED
            charges, returns = self._take_unreported()
            want = self._batch(limits)
            try:
                answer = await self._call("lease", tenant, want, charges, returns)
            except Exception:
                self._reported(charges, ok=False)
                return self.local.admit(tenant)
            self._seen(answer["snapshot"])
            self._reported(charges, ok=True)
            lease = self._leases[tenant]
            if answer["granted"] < 1:
                return Admission(False, answer["retry_after_s"], answer["limit"],
                                 answer["message"])
            if limits.requests_per_minute:
                lease.requests += answer["granted"] - 1
                lease.granted_at = time.monotonic()
            return ADMITTED

    def _fits(self, lease: _Lease, limits: TenantSettings) -> bool:
        """Whether a request may go from what this replica holds, without asking the actor."""
        if limits.requests_per_minute and lease.requests < 1:
            return False
        if limits.tokens_per_minute:
            if time.monotonic() - lease.seen > ACTIVE_S:  # others may have spent it since
                return False
            level = self._level(lease.tpm, lease.seen)
            return level is not None and level - lease.unflushed - lease.sending > 0
        return True

    def _batch(self, limits: TenantSettings) -> int:
        """Requests one lease takes: about LEASE_WINDOW_S of the tenant's rate among the
        routers, at least one (a tenant with TPM only takes one: nothing is leased)."""
        if not limits.requests_per_minute:
            return 1
        return max(1, math.floor(limits.requests_per_minute / 60 * LEASE_WINDOW_S
                                 / self.routers))

    @staticmethod
    def _level(bucket: list[float] | None, seen: float) -> float | None:
        if bucket is None:
            return None
        capacity, level, rate = bucket
        return min(capacity, level + (time.monotonic() - seen) * rate)

    def refund(self, tenant: str) -> None:
        """The admitted request was refused elsewhere: its request goes back to the lease."""
        if self.degraded:
            self.local.refund(tenant)
            return
        limits = self._limited(tenant)
        if limits is not None and limits.requests_per_minute:
            self._leases.setdefault(tenant, _Lease()).requests += 1

    def settle(self, tenant: str, tokens: int) -> None:
        """A finished request's tokens: counted here at once, reported in the next flush."""
        limits = self._limited(tenant)
        if limits is not None and limits.tokens_per_minute and tokens > 0:
            self._leases.setdefault(tenant, _Lease()).unflushed += tokens

    def state(self, tenant: str, pending_tokens: int = 0
              ) -> tuple[LimitState | None, LimitState | None] | None:
        """The rate-limit headers' figures from the actor's last word plus this replica's
        lease and unreported usage; None when there is no such word (use the local book)."""
        limits = self._limited(tenant)
        lease = self._leases.get(tenant)
        if limits is None or lease is None or self.degraded or not lease.seen:
            return None
        out: list[LimitState | None] = []
        for bucket, held, limit in ((lease.rpm, lease.requests, limits.requests_per_minute),
                                    (lease.tpm, -lease.unflushed - lease.sending
                                     - pending_tokens,
                                     limits.tokens_per_minute)):
            level = self._level(bucket, lease.seen)
            if level is None or bucket is None or not limit:
                out.append(None)
                continue
            remaining = level + held
            out.append(LimitState(limit, remaining,
                                  max(0.0, (bucket[0] - remaining) / bucket[2])))
        return out[0], out[1]
