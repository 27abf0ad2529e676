"""Which waiting request goes next: strict priority bands, fair between tenants within a band.

Within a band the backlogged tenant with the least *virtual service* goes first (VTC, Sheng et
al., OSDI 2024): a tenant's service is the tokens it was served, prompt + 2 x completion. The
admission controller charges a request's expected service when it is granted and the rest (or
the refund) when it ends (:meth:`FairQueue.charge`). Each band keeps a virtual clock: the
service of the tenant it last served (the least among its backlogged tenants at that moment).
A tenant that becomes backlogged is lifted to that clock, whether or not the band has other
waiters right now, so idling banks no credit to spend later in a burst. Within one tenant
requests keep their arrival order.

Every admission moves the clock, not only :meth:`FairQueue.pop`: the admission controller calls
:meth:`FairQueue.served` for requests that never waited (below capacity, a quiet tenant's first
request). Without it a tenant served below capacity for a long time left the clock at 0, and a
tenant idle meanwhile then went first for as long as the other's whole past service.

Several router replicas order by the app's service, not their own: :meth:`FairQueue.charged`
is what this queue charged (the figure the router reports), :meth:`FairQueue.set_remote` the
other routers' service as last reported, added to each tenant's virtual service like a charge
(:mod:`serve_app.governance.fair_share_sync` carries both through the quota actor). Without it a
tenant spreading its requests over two routers got about 3/4 against one using one router.

Pure data structure (no asyncio, no Ray); the router's admission controller drives it.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from typing import Callable, Generic, Hashable, Literal, Mapping, TypeVar

from serve_app.config import Priority
from serve_app.engine.priority import encode_priority

BANDS: tuple[Priority, ...] = ("high", "normal", "low")
T = TypeVar("T", bound=Hashable)


def service_of(prompt_tokens: int, completion_tokens: int) -> int:
    """VTC's weighting: output tokens cost about twice an input token on the GPU."""
    return prompt_tokens + 2 * completion_tokens


class FairQueue(Generic[T]):
    """Waiting items per (band, tenant); :meth:`pop` returns the next one to admit."""

    def __init__(self) -> None:
        self._waiting: dict[Priority, dict[str, deque[T]]] = {b: {} for b in BANDS}
        self._service: dict[str, float] = {}
        self._where: dict[T, tuple[Priority, str]] = {}
        # Per band: the virtual service of the tenant served last (VTC's virtual clock).
        self._clock: dict[Priority, float] = {b: 0.0 for b in BANDS}
        # Service charged here (lifts and the other routers' service left out), and the other
        # routers' service as last reported: both already inside ``_service``.
        self._charged: dict[str, float] = {}
        self._remote: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, item: T) -> bool:
        return item in self._where

    def waiting(self, band: Priority | None = None, tenant: str | None = None) -> int:
        """Items waiting in ``band`` (or in all bands), of ``tenant`` (or of every tenant)."""
        if tenant is not None:
            bands = BANDS if band is None else (band,)
            return sum(len(self._waiting[b].get(tenant, ())) for b in bands)
        if band is None:
            return len(self._where)
        return sum(len(q) for q in self._waiting[band].values())

    def tenants_waiting(self, band: Priority) -> int:
        """How many tenants have items waiting in ``band``."""
        return len(self._waiting[band])

    def service(self, tenant: str) -> float:
        """``tenant``'s virtual service: what it was charged here and elsewhere, and lifts."""
        return self._service.get(tenant, 0.0)

    def push(self, item: T, tenant: str, band: Priority = "normal") -> None:
        tenants = self._waiting[band]
        if tenant not in tenants:
            # Newly backlogged: no credit for the time it was idle (VTC's counter lift). The
            # floor is the least service among waiters, or the band's clock when none wait:
            # an empty band still remembers how far service has advanced.
            floor = min((self._service.get(t, 0.0) for t in tenants), default=self._clock[band])
            self._service[tenant] = max(self._service.get(tenant, 0.0), floor)
            tenants[tenant] = deque()
        tenants[tenant].append(item)
        self._where[item] = (band, tenant)

    def pop(self, eligible: Callable[[str], bool] | None = None) -> T | None:
        """The next item: highest band first, then the least-served tenant (ties: the tenant
        that has waited longest in the band), then arrival order. With ``eligible``, only
        tenants for which it holds are considered (a tenant at its concurrency cap must not
        hold the head: the others pass it)."""
        for band in BANDS:
            tenants = self._waiting[band]
            candidates = tenants if eligible is None else [t for t in tenants if eligible(t)]
            if not candidates:
                continue
            tenant = min(candidates, key=lambda t: self._service.get(t, 0.0))  # stable: FIFO
            self._clock[band] = max(self._clock[band], self._service.get(tenant, 0.0))
            q = tenants[tenant]
            item = q.popleft()
            if not q:
                del tenants[tenant]
            else:  # move to the back among equals, so equal tenants alternate
                tenants[tenant] = tenants.pop(tenant)
            del self._where[item]
            return item
        return None

    def pop_where(self, pred: Callable[[T], bool]) -> T | None:
        """Remove and return the first waiting item (any band) for which ``pred`` holds."""
        item = next((i for i in self._where if pred(i)), None)
        if item is not None:
            self.remove(item)
        return item

    def served(self, tenant: str, band: Priority, newly_active: bool) -> None:
        """A request of ``tenant`` went to an engine without waiting here. ``newly_active``: the
        tenant had nothing in flight (nor waiting), so it is lifted to the band's clock like a
        tenant that becomes backlogged; either way the clock moves to its service."""
        service = self._service.get(tenant, 0.0)
        if newly_active:
            service = self._service[tenant] = max(service, self._clock[band])
        self._clock[band] = max(self._clock[band], service)

    def remove(self, item: T) -> bool:
        """Drop a waiting item (its client left); False if it was not waiting."""
        where = self._where.pop(item, None)
        if where is None:
            return False
        band, tenant = where
        q = self._waiting[band][tenant]
        q.remove(item)
        if not q:
            del self._waiting[band][tenant]
        return True

    def charge(self, tenant: str, service: float) -> None:
        """Add ``service`` (see :func:`service_of`) to ``tenant``'s virtual service."""
        self._service[tenant] = self._service.get(tenant, 0.0) + service
        self._charged[tenant] = self._charged.get(tenant, 0.0) + service

    def charged(self) -> dict[str, float]:
        """Service charged here per tenant since the queue began (what the router reports:
        cumulative, so a report sent twice counts once); lifts and remote service excluded."""
        return dict(self._charged)

    def set_remote(self, service: Mapping[str, float]) -> None:
        """The other routers' service per tenant (cumulative; a tenant absent: none). Each
        tenant's virtual service moves by the change since the last call, as a charge would
        (down too: requests elsewhere give back prepaid service when they end). A tenant newly
        backlogged is still lifted to the band's floor, on this sum: idling banks no credit
        here, whatever router served it."""
        for tenant in set(self._remote) | set(service):
            new = service.get(tenant, 0.0)
            delta = new - self._remote.get(tenant, 0.0)
            if delta:
                self._service[tenant] = self._service.get(tenant, 0.0) + delta
            if new:
                self._remote[tenant] = new
            else:
                self._remote.pop(tenant, None)


class FifoQueue(Generic[T]):
    """The baseline: one queue in arrival order, blind to tenants and priorities (what Serve's or
    vLLM's own queues do). Same interface as :class:`FairQueue`, for comparisons."""

    def __init__(self) -> None:
        self._items: OrderedDict[T, tuple[Priority, str]] = OrderedDict()
        # Items per (band, tenant): the admission controller's queue bounds read them.
        self._counts: Counter[tuple[Priority, str]] = Counter()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, item: T) -> bool:
        return item in self._items

    def waiting(self, band: Priority | None = None, tenant: str | None = None) -> int:
        if tenant is not None:
            return sum(self._counts[(b, tenant)] for b in (BANDS if band is None else (band,))
                       if (b, tenant) in self._counts)
        if band is None:
            return len(self._items)
        return sum(n for (b, _), n in self._counts.items() if b == band)

    def tenants_waiting(self, band: Priority) -> int:
        return sum(1 for b, _ in self._counts if b == band)

    def push(self, item: T, tenant: str, band: Priority = "normal") -> None:
        self._items[item] = (band, tenant)
        self._counts[(band, tenant)] += 1

    def pop(self, eligible: Callable[[str], bool] | None = None) -> T | None:
        if eligible is None:
            return self.pop_where(lambda i: True)
        return self.pop_where(lambda i: eligible(self._items[i][1]))

    def pop_where(self, pred: Callable[[T], bool]) -> T | None:
        item = next((i for i in self._items if pred(i)), None)
        if item is not None:
            self.remove(item)
        return item

    def remove(self, item: T) -> bool:
        where = self._items.pop(item, None)
        if where is None:
            return False
        self._counts[where] -= 1
        if not self._counts[where]:
            del self._counts[where]
        return True

    def served(self, tenant: str, band: Priority, newly_active: bool) -> None:
        pass

    def charge(self, tenant: str, service: float) -> None:
        pass

    def charged(self) -> dict[str, float]:
        return {}

    def set_remote(self, service: Mapping[str, float]) -> None:
        pass


def engine_priority(band: Priority, tenant_in_flight: int) -> int:
    """vLLM priority (lower runs first) of a request released now: its band first, then how
    many requests its tenant already has in the engines.

    The few requests the router lets wait inside an engine are ordered by it, so a quiet
    tenant's request starts at the engine's next free slot instead of behind a flood. The
    tenant's VTC service is not used here: a tenant that was idle is lifted to the band's clock,
    which would rank it behind every flood request released before it (measured on an H200:
    6.7 s TTFT for the quiet tenant). vLLM breaks ties by arrival; under KV pressure it
    preempts the running request with the largest value, so the heaviest tenant yields first.
    """
    return encode_priority(BANDS.index(band), tenant_in_flight)


QueuePolicy = Literal["fair", "fifo"]
QUEUE_POLICIES: dict[str, type] = {"fair": FairQueue, "fifo": FifoQueue}
