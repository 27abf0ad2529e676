"""Which waiting request goes next: strict priority bands, fair between tenants within a band.

Within a band the backlogged tenant with the least *virtual service* goes first (VTC, Sheng et
al., OSDI 2024): a tenant's service is the tokens it was served, prompt + 2 x completion, charged
when a request ends. A tenant that becomes backlogged is lifted to the least service among the
tenants already waiting in its band, so idling banks no credit to spend later in a burst. Within
one tenant requests keep their arrival order.

Pure data structure (no asyncio, no Ray); the router's admission controller drives it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Generic, Hashable, Literal, TypeVar

from serve_app.config import Priority

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

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, item: T) -> bool:
        return item in self._where

    def waiting(self, band: Priority | None = None) -> int:
        """Items waiting in ``band`` (or in all bands)."""
        if band is None:
            return len(self._where)
        return sum(len(q) for q in self._waiting[band].values())

    def service(self, tenant: str) -> float:
        return self._service.get(tenant, 0.0)

    def push(self, item: T, tenant: str, band: Priority = "normal") -> None:
        tenants = self._waiting[band]
        if tenant not in tenants:
            # Newly backlogged: no credit for the time it was idle (VTC's counter lift).
            if tenants:
                floor = min(self._service.get(t, 0.0) for t in tenants)
                self._service[tenant] = max(self._service.get(tenant, 0.0), floor)
            tenants[tenant] = deque()
        tenants[tenant].append(item)
        self._where[item] = (band, tenant)

    def pop(self) -> T | None:
        """The next item: highest band first, then the least-served tenant (ties: the tenant
        that has waited longest in the band), then arrival order."""
        for band in BANDS:
            tenants = self._waiting[band]
            if not tenants:
                continue
            tenant = min(tenants, key=lambda t: self._service.get(t, 0.0))  # stable: FIFO ties
            q = tenants[tenant]
            item = q.popleft()
            if not q:
                del tenants[tenant]
            else:  # move to the back among equals, so equal tenants alternate
                tenants[tenant] = tenants.pop(tenant)
            del self._where[item]
            return item
        return None

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


class FifoQueue(Generic[T]):
    """The baseline: one queue in arrival order, blind to tenants and priorities (what Serve's or
    vLLM's own queues do). Same interface as :class:`FairQueue`, for comparisons."""

    def __init__(self) -> None:
        self._items: OrderedDict[T, Priority] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, item: T) -> bool:
        return item in self._items

    def waiting(self, band: Priority | None = None) -> int:
        if band is None:
            return len(self._items)
        return sum(1 for b in self._items.values() if b == band)

    def push(self, item: T, tenant: str, band: Priority = "normal") -> None:
        self._items[item] = band

    def pop(self) -> T | None:
        return self._items.popitem(last=False)[0] if self._items else None

    def remove(self, item: T) -> bool:
        return self._items.pop(item, None) is not None

    def charge(self, tenant: str, service: float) -> None:
        pass


QueuePolicy = Literal["fair", "fifo"]
QUEUE_POLICIES: dict[str, type] = {"fair": FairQueue, "fifo": FifoQueue}
