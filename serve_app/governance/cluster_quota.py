"""One quota state per cluster: every router replica enforces a tenant's whole RPM and TPM
together, through one Ray actor, with leases so the hot path makes no remote call per request.

**The actor** (:class:`~serve_app.governance.quota_state.QuotaState`, one per app, detached, named
``<app>-quota``) holds each tenant's buckets at their full size, follows the live tenant list
and checkpoints its buckets (see :mod:`serve_app.governance.quota_state`).

**Router replicas** (:class:`ClusterQuota`) take request tokens in leases: one call takes about a
second's worth of the tenant's rate divided among the routers (at least one), and requests
are then admitted from the lease locally. Unused leases go back after ``LEASE_TTL_S``, except a
lease that is a whole ``LEASE_WINDOW_S`` of the tenant's rate (not raised to one request): that
one stays until used, so a tenant's first request after an idle spell makes no call. Token
usage (charged as tokens flow) is reported in batches every ``FLUSH_S``, and each answer
carries the tenant's token level, which admission checks locally, less what this replica
charged since. A replica that restarts starts with no lease: the actor's buckets are where they
were, so a restart does not refill anyone.

**Error bound** with N router replicas: requests never pass the limit (a lease is taken out of
the bucket before it is used; an unused lease is capacity held back for at most
``LEASE_TTL_S``, and lost with a replica that dies holding it), except by the idle leases kept:
at most ``LEASE_WINDOW_S`` of the tenant's rate over all the replicas (1/60 of its
requests per minute), held back while idle and spent on top of a full bucket after the idle
spell. That is the price of no call on an idle tenant's next request: giving every lease back
after 2 s made such a request wait for one (the c=1 TTFT of a governed stack on one H200,
bench/RESULTS.md 37k). Tokens can pass the limit by
what the tenant has in flight plus what the other replicas charged within the last
``FLUSH_S`` (each replica sees its own charges at once), as with one replica plus that window.

**The failure rule** (one, for an actor that fails and one that hangs): a call that gets no
answer within ``CALL_TIMEOUT_S`` (or fails) starts an *outage* of this replica. At once, every
request waiting on the actor (the calls in flight beside it, and the tenant's requests queued
behind its call) is admitted from the replica's local share (1/N of every limit, the replica's
own buckets), and so is every later request: none calls the actor again one by one. There is
at most one lease call in flight per tenant (the others wait for its answer, never for a call
of their own), and the batched report is not sent beside a call still unanswered, so no
request waits on the actor for more than ``CALL_TIMEOUT_S``. During the outage one
background call (a report, carrying the usage charged meanwhile) probes the actor every
``RETRY_S``; its answer ends the outage: the replica's leases take the actor's word again and
the charges made meanwhile are in the actor's buckets. :attr:`ClusterQuota.degraded` (and the
``serve_app_quota_degraded`` gauge, alert ``ServeAppQuotaDegraded``) is 1 during an outage.
The share starts from the actor's last word, not full: each tenant this replica has seen gets 1/N
of what the actor said was left (refilled to now), plus its unused lease, less its unreported
usage, so losing the actor refills nobody. A tenant the replica had not seen starts its share
full: during an outage, a tenant can pass its limit by the shares of the replicas that had not
served it. A call abandoned on time-out may still run on the actor later: a lease it takes is
capacity held back until the bucket refills, and charges it carried are sent again (they
count twice rather than never).

**Fair share** over the routers rides on the same report: with several router replicas each
report also carries this replica's fair-share service and brings back the others'
(:mod:`serve_app.governance.fair_share_sync`: what is sent, how the queues use it, and the
failure rule's consequence, the local view until the actor answers again).

The calls, their time-outs and outages are :class:`~serve_app.governance.quota_link.ActorLink`'s;
the replica's first call waits up to ``STARTUP_TIMEOUT_S``: it may create the actor, whose
worker takes seconds to start on a loaded host.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Any, Mapping

from serve_app.config import TenantSettings
from serve_app.governance.fair_share_sync import FairShareSync, ServiceQueue
from serve_app.governance.quota_link import ActorLink
from serve_app.governance.quota_state import (  # noqa: F401 (importable from here, as before)
    NAMESPACE,
    QuotaState,
    _checkpoint_key,
    actor_name,
)
from serve_app.governance.headers import LimitState
from serve_app.governance.quota import ADMITTED, Admission, QuotaBook

FLUSH_S = 0.25
LEASE_WINDOW_S = 1.0
LEASE_TTL_S = 2.0
# A tenant this replica served within this long has its buckets re-read at every flush; an
# older view is re-read before the tenant's next request is admitted on it.
ACTIVE_S = 5.0


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
        # The failure rule's calls; on an outage the local shares start from the last word.
        self._link = ActorLink(lambda: self._get_actor(), self._seed_local_shares, routers)
        self._probe: asyncio.Task[None] | None = None
        self._flusher: asyncio.Task[None] | None = None
        # Alone, a router's own service is the app's: nothing to share.
        self.fair_share = FairShareSync() if routers > 1 else None

    def share_service(self, queues: Mapping[str, ServiceQueue]) -> None:
        """Order these models' fair queues (model name -> queue) by the service the whole app
        gave each tenant (with several router replicas; see the module docstring)."""
        if self.fair_share is not None:
            self.fair_share.attach(queues)

    def update(self, tenants: list[TenantSettings]) -> None:
        """A new live tenant list: a tenant whose limits changed starts a fresh lease."""
        old, self._limits = self._limits, {t.name: t for t in tenants}
        for name in list(self._leases):
            a, b = old.get(name), self._limits.get(name)
            if b is None or a is None or (a.requests_per_minute, a.tokens_per_minute) != (
                    b.requests_per_minute, b.tokens_per_minute):
                self._leases.pop(name)

    @property
    def link(self) -> ActorLink:
        """The calls to the actor (shared with the replica's concurrency slots)."""
        return self._link

    @property
    def degraded(self) -> bool:
        """Whether this replica enforces its local share now: the actor did not answer in
        time, and has not answered since (an outage; see the module docstring)."""
        return self._link.outage

    def _limited(self, tenant: str) -> TenantSettings | None:
        t = self._limits.get(tenant)
        return t if t is not None and (t.requests_per_minute or t.tokens_per_minute) else None

    # -- the actor ------------------------------------------------------------------------------
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
            if (lease.requests and now - lease.granted_at > LEASE_TTL_S
                    and not self._kept_idle(tenant)):
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
            # Kept fresh, not only set when it changes: a series written once at a replica's
            # first request was absent from Prometheus minutes later in the full suite.
            self._link.publish_gauge()
            if self._link.outage:
                self._maybe_probe()
            elif not self._link.in_flight:  # never a report beside a call still unanswered
                await self._report(probe=False)

    def _maybe_probe(self) -> None:
        """During an outage, once RETRY_S has passed since the last try: one report, in the
        background (no request waits on it); its answer ends the outage."""
        if (self._probe is None or self._probe.done()) and self._link.probe_due():
            self._probe = asyncio.get_running_loop().create_task(self._report(probe=True))

    async def _report(self, probe: bool) -> None:
        """Report the unreported charges and returns, and re-read the active tenants'
        buckets (a ``probe`` goes even with nothing to report)."""
        charges, returns = self._take_unreported()
        now = time.monotonic()
        tenants = [t for t, lease in self._leases.items() if self._limited(t)
                   and (now - lease.used < ACTIVE_S or t in charges)]
        # Fair share rides along only to an actor known to take it (a detached actor of an
        # older version outlives deploys; an unknown argument would begin an outage). With no
        # handle yet, a plain report looks the actor up; the next one carries the service.
        wanted = self.fair_share.outgoing() if self.fair_share is not None else None
        actor = self._link.actor
        if wanted is not None and actor is not None and not hasattr(actor, "share_service"):
            wanted = None
        service = wanted if actor is not None else None
        if not (charges or returns or tenants or probe or wanted):
            return
        try:
            answer = await self._link.call("report", charges, returns, tenants,
                                           *(() if service is None else (service,)))
        except Exception:
            self._reported(charges, ok=False)  # reported when the actor answers again
        else:
            if service is not None:
                assert self.fair_share is not None
                self.fair_share.answered(service, answer["service"])
                answer = answer["buckets"]
            self._seen(answer)
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
        lease = self._leases.setdefault(tenant, _Lease())
        lease.used = time.monotonic()
        if self._link.outage:
            self._maybe_probe()
            return self.local.admit(tenant)
        if self._fits(lease, limits):
            lease.requests -= bool(limits.requests_per_minute)
            return ADMITTED
        lock = self._locks.setdefault(tenant, asyncio.Lock())
        async with lock:  # one lease call in flight per tenant; the others wait for it
            if self._link.outage:  # its call timed out or failed: never a call of our own
                return self.local.admit(tenant)
            lease = self._leases.setdefault(tenant, _Lease())
            if self._fits(lease, limits):  # another request's lease call brought enough
                lease.requests -= bool(limits.requests_per_minute)
                return ADMITTED
            charges, returns = self._take_unreported()
            want = self._batch(limits)
            try:
                answer = await self._link.call("lease", tenant, want, charges, returns)
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

    def _kept_idle(self, tenant: str) -> bool:
        """Whether ``tenant``'s unused lease stays past ``LEASE_TTL_S``: when a lease is a
        whole ``LEASE_WINDOW_S`` of its rate among the routers (see the module docstring's
        error bound), not one request raised from less (a tenant of 6 requests a minute: one
        held idle would be a sixth of its limit)."""
        limits = self._limited(tenant)
        return bool(limits is not None and limits.requests_per_minute
                    and limits.requests_per_minute / 60 * LEASE_WINDOW_S / self.routers >= 1)

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

    def publish_degraded(self) -> None:
        """Publish the ``serve_app_quota_degraded`` gauge with the current state (called at the
        router replica's first request), and keep it published from the flush loop."""
        self._link.publish_gauge()
        if self._flusher is None:
            self._flusher = asyncio.get_running_loop().create_task(self._flush_forever())

    def state(self, tenant: str, pending_tokens: int = 0
              ) -> tuple[LimitState | None, LimitState | None] | None:
        """The rate-limit headers' figures from the actor's last word plus this replica's
        lease and unreported usage: the actor's buckets hold the tenant's whole limits, so the
        figures are the tenant's. None during an outage or before the actor's first word: use
        the local book, whose figures are its share scaled to the tenant's limits
        (:meth:`~serve_app.governance.quota.QuotaBook.state`), as its admission is now."""
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
