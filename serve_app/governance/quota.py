"""Per-tenant quotas: requests per minute and tokens per minute, as token buckets.

* RPM: a request takes one token from the tenant's request bucket when admitted.
* TPM: tokens are debited as they flow (prompt + completion, from the engine's counts, per chunk
  the router receives; a request whose client left during its prefill pays its prompt's
  estimate: :mod:`serve_app.governance.accounting`); a request is admitted while the tenant's token
  bucket is above zero. A tenant can overshoot by what its requests in flight generate before
  the bucket reaches zero, and then waits until it refills; nothing is charged for tokens never
  produced. TPM reserves nothing at admission, unlike a token budget: with the cluster-wide
  quota the charges go to the quota actor in batches that only add (a reservation's unused part
  could not be given back there), and a rate refills within the minute anyway.

Buckets hold a minute's worth (a full minute's budget may be spent in a burst) and refill
continuously. This book is one router replica's: with ``quota_scope: replica``, or while the
cluster's quota actor does not answer, each of several router replicas holds ``1/replicas`` of
every limit (``share``); otherwise the buckets live in the quota actor
(:mod:`serve_app.governance.cluster_quota`). The rate-limit headers still state the tenant's
whole limits (:meth:`QuotaBook.state`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

from serve_app.config import TenantSettings
from serve_app.governance.headers import LimitState, share_remaining


@dataclass(slots=True)
class TokenBucket:
    """``capacity`` tokens at most, refilled at ``rate`` per second; the level may go negative
    through :meth:`take` (usage reported after the fact)."""

    capacity: float
    rate: float
    level: float = field(default=math.nan)
    updated: float = 0.0

    def __post_init__(self) -> None:
        if math.isnan(self.level):
            self.level = self.capacity

    def _refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
            self.updated = now

    def wait_for(self, n: float, now: float) -> float:
        """Seconds until ``n`` tokens are available (0 if they are now). Takes nothing."""
        self._refill(now)
        return 0.0 if self.level >= n else (n - self.level) / self.rate

    def take(self, n: float, now: float) -> None:
        """Remove ``n`` tokens; usage charged after the fact may leave the level below zero."""
        self._refill(now)
        self.level -= n

    def state(self, limit: int, now: float, pending: float = 0.0, need: float = 1.0
              ) -> LimitState:
        """What a client sees of this bucket now, ``pending`` tokens already taken: ``limit``
        (the tenant's configured figure, also when this bucket holds only a router's share
        of it), what is left of it (:func:`~serve_app.governance.headers.share_remaining`:
        ``need`` is the level that admits one more request), and the time until the bucket
        is full again."""
        self._refill(now)
        level = self.level - pending
        return LimitState(limit, share_remaining(level, self.capacity, limit, need),
                          max(0.0, (self.capacity - level) / self.rate))


@dataclass(frozen=True, slots=True)
class Admission:
    """The quota decision: admitted, or which limit refused and when to retry."""

    admitted: bool
    retry_after_s: float = 0.0
    limit: str | None = None  # "requests_per_minute" or "tokens_per_minute"
    message: str = ""


ADMITTED = Admission(True)


class QuotaBook:
    """Quota state of every tenant held by one router replica."""

    def __init__(self, tenants: list[TenantSettings], share: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < share <= 1:
            raise ValueError("share must be in (0, 1]")
        self.clock = clock
        self.share = share
        self._rpm: dict[str, TokenBucket] = {}
        self._tpm: dict[str, TokenBucket] = {}
        self._limits: dict[str, TenantSettings] = {}
        self.update(tenants)

    def update(self, tenants: list[TenantSettings]) -> None:
        """Take a new tenant list (a live config change). A tenant whose limits did not change
        keeps its buckets as they are (a redeploy must not refill anyone's quota); changed
        limits start full; removed tenants are dropped."""
        now = self.clock()
        rpm, tpm = self._rpm, self._tpm
        old = self._limits
        self._rpm, self._tpm = {}, {}
        self._limits = {t.name: t for t in tenants}
        for t in tenants:
            prev = old.get(t.name)
            if t.requests_per_minute:
                if prev and prev.requests_per_minute == t.requests_per_minute and t.name in rpm:
                    self._rpm[t.name] = rpm[t.name]
                else:
                    cap = t.requests_per_minute * self.share
                    self._rpm[t.name] = TokenBucket(max(cap, 1.0), cap / 60, updated=now)
            if t.tokens_per_minute:
                if prev and prev.tokens_per_minute == t.tokens_per_minute and t.name in tpm:
                    self._tpm[t.name] = tpm[t.name]
                else:
                    cap = t.tokens_per_minute * self.share
                    self._tpm[t.name] = TokenBucket(cap, cap / 60, updated=now)

    def admit(self, tenant: str) -> Admission:
        """Admit one request of ``tenant`` now (taking from its request bucket) or refuse it
        with the wait after which a retry can succeed. Unknown tenants have no limits."""
        now = self.clock()
        tpm = self._tpm.get(tenant)
        if tpm is not None:
            wait = tpm.wait_for(1e-9, now)  # admitted while above zero
            if wait > 0:
                limit = self._limits[tenant].tokens_per_minute
                return Admission(False, wait, "tokens_per_minute",
                                 f"tenant {tenant} is over its limit of {limit} tokens per "
                                 f"minute; retry in {math.ceil(wait)} s")
        rpm = self._rpm.get(tenant)
        if rpm is not None:
            wait = rpm.wait_for(1, now)
            if wait > 0:
                limit = self._limits[tenant].requests_per_minute
                return Admission(False, wait, "requests_per_minute",
                                 f"tenant {tenant} is over its limit of {limit} requests per "
                                 f"minute; retry in {math.ceil(wait)} s")
            rpm.take(1, now)
        return ADMITTED

    def admit_many(self, tenant: str, want: int) -> tuple[int, Admission]:
        """Admit up to ``want`` requests of ``tenant`` now, as ``want`` calls of :meth:`admit`
        would, in a fixed number of steps (a lease of a tenant with a high request rate asks
        for a second's worth: 166,667 requests at 10 million per minute; counted one at a
        time, that held every new lease 130 ms, and a request after 2 s idle waited for one).
        Returns how many were admitted and, when fewer than
        ``want``, the refusal that stopped the count (else :data:`ADMITTED`)."""
        if want < 1:
            return 0, ADMITTED
        first = self.admit(tenant)  # the token check, and the wait of a refusal
        if not first.admitted:
            return 0, first
        rpm = self._rpm.get(tenant)
        if rpm is None:  # admit() takes nothing without a request limit: all pass alike
            return want, ADMITTED
        rpm._refill(self.clock())
        more = min(want - 1, max(0, math.floor(rpm.level)))
        rpm.level -= more
        granted = 1 + more
        if granted == want:
            return granted, ADMITTED
        last = self.admit(tenant)  # the refusal (or one refilled meanwhile)
        return (granted + 1, ADMITTED) if last.admitted else (granted, last)

    def refund(self, tenant: str) -> None:
        """Give back the request token of an admitted request that was then refused elsewhere
        (its model's queue was full): a refused request costs no quota."""
        rpm = self._rpm.get(tenant)
        if rpm is not None:
            rpm.take(-1, self.clock())

    def seed(self, tenant: str, requests: float | None, tokens: float | None) -> None:
        """Set ``tenant``'s request and token bucket levels as of now (None: leave that bucket),
        at most their capacity: a replica taking over enforcement starts from what it was told
        is left, not from full buckets."""
        now = self.clock()
        for bucket, level in ((self._rpm.get(tenant), requests), (self._tpm.get(tenant), tokens)):
            if bucket is not None and level is not None:
                bucket.level, bucket.updated = min(bucket.capacity, level), now

    def state(self, tenant: str, pending_tokens: int = 0
              ) -> tuple[LimitState | None, LimitState | None]:
        """``tenant``'s request and token buckets as the rate-limit headers report them (None:
        no such limit); ``pending_tokens``: tokens of a request that ended but is not settled
        yet. The limits are the tenant's (not this replica's share of them), ``remaining``
        this replica's share scaled to the limit, 0 while the share would refuse the next
        request (the rule: :mod:`serve_app.governance.headers`)."""
        now = self.clock()
        rpm, tpm = self._rpm.get(tenant), self._tpm.get(tenant)
        limits = self._limits.get(tenant)
        return (None if rpm is None or limits is None
                else rpm.state(limits.requests_per_minute or 0, now),
                # admit() takes a request while the token level is above zero
                None if tpm is None or limits is None
                else tpm.state(limits.tokens_per_minute or 0, now, pending_tokens, need=1e-9))

    def settle(self, tenant: str, tokens: int) -> None:
        """Charge ``tokens`` (prompt or completion) a request of ``tenant`` used, as they flow."""
        tpm = self._tpm.get(tenant)
        if tpm is not None and tokens > 0:
            tpm.take(tokens, self.clock())
