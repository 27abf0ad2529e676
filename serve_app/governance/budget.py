"""Token budgets over a calendar window: ``token_budget: {tokens: N, period: day|month}``.

A tenant with a budget is charged prompt + completion tokens as they flow (the same figures as
its TPM and its usage record; :mod:`serve_app.governance.accounting`). Each request *reserves* its
most at admission: its prompt's estimated tokens plus ``n x max_tokens``
(``router.budget_reserve_max_tokens`` per choice when the client gave no limit). A request is admitted while
the window's spend plus the tokens reserved by requests in flight is below ``tokens``; its
reservation shrinks as its tokens are charged, and the unused part is released when it ends.
Once spent, every request gets 429 ``insufficient_quota`` (OpenAI's code when credit runs out)
until the window ends: midnight UTC for ``day``, the first of the month (UTC) for ``month``.

So, on one router replica, requests started together spend at most the budget plus the last
admitted request's reservation (measured before reservations: 200 requests started together
spent 839x a 1,000-token budget). A request that generates past its reservation (no
``max_tokens`` and more than ``budget_reserve_max_tokens``) can overshoot by that excess.

The spend must outlive router replicas and redeploys, and several router replicas charge the
same tenant. So each router replica keeps its own spend per (tenant, window) as one record,
written under its own key; a tenant's spend is the sum of every record of the window (records of
replicas that are gone still count). Reservations are local to the replica that holds them:
they are never written, so a replica that dies leaves only what its requests really used.
:class:`BudgetBook` is the pure bookkeeping; :mod:`serve_app.governance.budgets` moves records to
and from Ray's key-value store, and deletes past windows' records.

Reservations are not shared between router replicas, so with N of them each replica holds its
requests' reservations to its part of what is left: it admits a request of reservation ``r``
while ``spend + N x held + (N - 1) x r`` is below the budget (``held``: its own requests'
reservations in flight). The replicas' reservations together then stay within what is left plus
one request's, so requests started together on every replica spend at most the budget plus one
reservation, as on one replica (issue 37: 40 requests of 65 tokens spread over two replicas, each
admitting while its own reservations stayed below the whole budget, spent 2,600 of a 2,000-token
budget). The price: a replica refuses a request while less than ``(N - 1) x r`` is left
(``N = 1``: the rule above, unchanged). A tenant can still pass its budget by what the other
replicas charged since their last record was read (one sync interval, 1 s by default).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable

from serve_app.config import TenantSettings


def window_of(period: str, now: float) -> tuple[str, float]:
    """The window containing ``now`` (UNIX seconds) for ``period``: its id (``2026-12-03`` or
    ``2026-12``) and when it ends (UNIX seconds). UTC calendar days and months."""
    t = datetime.fromtimestamp(now, timezone.utc)
    if period == "day":
        start = t.replace(hour=0, minute=0, second=0, microsecond=0)
        end = datetime.fromtimestamp(start.timestamp() + 86400, timezone.utc)
        return start.strftime("%Y-%m-%d"), end.timestamp()
    if period == "month":
        year, month = (t.year + 1, 1) if t.month == 12 else (t.year, t.month + 1)
        end = datetime(year, month, 1, tzinfo=timezone.utc)
        return t.strftime("%Y-%m"), end.timestamp()
    raise ValueError(f"unknown budget period {period!r}")


# Retry-After of a request turned away because the rest of the budget is reserved in flight.
RESERVED_RETRY_S = 1.0


@dataclass(frozen=True, slots=True)
class BudgetRefusal:
    """A refused request: the 429's message and when to try again (UNIX seconds): the window's
    end once the budget is spent, a second away while the rest is only reserved in flight."""

    message: str
    resets_at: float

    def retry_after_s(self, now: float) -> float:
        return max(0.0, self.resets_at - now)


def past_window(window: str, current: str) -> bool:
    """Whether ``window`` (an id of :func:`window_of`) ended before ``current`` of the same
    period. A window later than ``current`` is not past: a replica whose clock lags must not
    delete a record another replica has already started for the next day."""
    return len(window) == len(current) and window < current


@dataclass(slots=True)
class _Spend:
    window: str
    ends: float = 0.0     # when the window ends (UNIX seconds)
    own: int = 0          # charged by this router replica in the window (its record)
    held: int = 0         # reserved by this replica's requests in flight (never written)
    others: int = 0       # every other record of the window, as last read
    written: int = 0      # ``own`` as last written to the store (no record: 0)
    read: bool = False    # the store was read for this window at least once


@dataclass
class BudgetBook:
    """Budget spend of every tenant with a budget, as one router replica knows it. Single-
    threaded (the router's event loop); ``clock`` gives UNIX seconds."""

    tenants: list[TenantSettings]
    clock: Callable[[], float] = time.time
    routers: int = 1  # router replicas sharing the budgets (see the module docstring)
    _spend: dict[str, _Spend] = field(default_factory=dict)
    _limits: dict[str, TenantSettings] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.update(self.tenants)

    def update(self, tenants: list[TenantSettings]) -> None:
        """A new tenant list: budgets follow it; spend is kept (a redeploy or a raised budget
        never refills anyone: the record lives on in the store)."""
        self._limits = {t.name: t for t in tenants if t.token_budget is not None}
        for name in list(self._spend):
            if name not in self._limits:
                del self._spend[name]

    def budgeted(self) -> list[str]:
        return sorted(self._limits)

    def _current(self, tenant: str) -> _Spend | None:
        limits = self._limits.get(tenant)
        if limits is None or limits.token_budget is None:
            return None
        now = self.clock()
        spend = self._spend.get(tenant)
        if spend is not None and now < spend.ends:  # per chunk: no calendar arithmetic
            return spend
        window, ends = window_of(limits.token_budget.period, now)
        if spend is None or spend.window != window:  # a new window starts at zero
            # Reservations of requests still running from the last window are dropped: what
            # they use from now on is charged to the new one.
            spend = self._spend[tenant] = _Spend(window, ends)
        spend.ends = ends
        return spend

    def spent(self, tenant: str) -> int | None:
        """Tokens ``tenant`` spent in its current window (None: no budget)."""
        spend = self._current(tenant)
        return None if spend is None else spend.own + spend.others

    def held(self, tenant: str) -> int:
        """Tokens reserved by ``tenant``'s requests in flight on this replica (0: no budget)."""
        spend = self._current(tenant)
        return 0 if spend is None else spend.held

    def check(self, tenant: str, tokens: int = 0) -> BudgetRefusal | None:
        """None while ``tenant`` may start a request that reserves ``tokens``: its spend plus
        what its requests in flight reserved is below its budget, this replica's reservations
        (its requests' and this one's) counted as every replica's (see the module docstring);
        the refusal once that is used up."""
        spend = self._current(tenant)
        if spend is None:
            return None
        budget = self._limits[tenant].token_budget
        assert budget is not None
        n = self.routers
        spent = spend.own + spend.others
        if spent + n * spend.held + (n - 1) * tokens < budget.tokens:
            return None
        if spent < budget.tokens and spend.held:
            # What is left is held by requests in flight: they give back what they do not use
            # as they end, so this is a wait of seconds, not the window's hours. (With nothing
            # held, what is left is too little for this request's share over the routers: that
            # waits for the window, or a new tenant list.)
            return BudgetRefusal(
                f"tenant {tenant} has {budget.tokens - spent} of its {budget.tokens} tokens per "
                f"{budget.period} left, all reserved by its requests in flight (each holds its "
                "prompt and max_tokens until it ends); retry when some finish",
                self.clock() + RESERVED_RETRY_S)
        _, ends = window_of(budget.period, self.clock())
        when = datetime.fromtimestamp(ends, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        return BudgetRefusal(
            f"tenant {tenant} has used its budget of {budget.tokens} tokens per "
            f"{budget.period}; it resets at {when} (in {math.ceil(ends - self.clock())} s)",
            ends)

    def reserve(self, tenant: str, tokens: int) -> int:
        """Hold ``tokens`` for a request being admitted (call right after :meth:`check` said
        None, with no await between); returns what is held (0: ``tenant`` has no budget)."""
        spend = self._current(tenant)
        if spend is None or tokens <= 0:
            return 0
        spend.held += tokens
        return tokens

    def release(self, tenant: str, tokens: int) -> None:
        """Give back ``tokens`` of what :meth:`reserve` held (charged or unused)."""
        spend = self._current(tenant)
        if spend is not None and tokens > 0:
            spend.held = max(0, spend.held - tokens)

    def charge(self, tenant: str, tokens: int) -> None:
        """A request of ``tenant`` used ``tokens`` more (prompt + completion, as they flow)."""
        spend = self._current(tenant)
        if spend is not None and tokens > 0:
            spend.own += tokens

    # -- the store's side (serve_app/governance/budgets.py) ----------------------------------------
    def windows(self) -> dict[str, str]:
        """Tenant -> its current window id, for every tenant with a budget."""
        out = {}
        for tenant in self._limits:
            spend = self._current(tenant)
            assert spend is not None
            out[tenant] = spend.window
        return out

    def unwritten(self) -> dict[tuple[str, str], int]:
        """(tenant, window) -> this replica's spend, for records not yet written as they are."""
        return {(t, s.window): s.own for t, s in self._spend.items()
                if t in self._limits and s.own != s.written}

    def written(self, tenant: str, window: str, own: int) -> None:
        """The store now holds ``own`` as this replica's record of ``tenant``'s ``window``."""
        spend = self._spend.get(tenant)
        if spend is not None and spend.window == window:
            spend.written = own

    def merge(self, tenant: str, window: str, others: int, own_stored: int = 0) -> None:
        """What the store holds for ``tenant``'s ``window``: ``others``, the sum of the other
        replicas' records; ``own_stored``, this replica's record (more than it knows only when
        it restarted under the same id)."""
        spend = self._spend.get(tenant)
        if spend is None or spend.window != window:
            return
        spend.others = others
        if own_stored > spend.own:
            spend.own = spend.written = own_stored
        spend.read = True

    def assume_read(self) -> None:
        """The store could not be read: go on with what this replica knows (fail open)."""
        for tenant in self.windows():
            self._spend[tenant].read = True

    def ready(self, tenant: str | None = None) -> bool:
        """Whether ``tenant``'s current window (every budgeted tenant's, without one) has been
        read from the store: a replica that just started must not admit a spent tenant before
        it knows. True for a tenant without a budget."""
        if tenant is not None:
            spend = self._current(tenant)
            return spend is None or spend.read
        return all(self._spend[t].read for t in self.windows())
