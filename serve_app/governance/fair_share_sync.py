"""Fair share over several router replicas: each router's fair queues order tenants by the
service the whole app gave them, not only what that router served (issue 37, item 3).

Each router's :class:`~serve_app.governance.fair_queue.FairQueue` charges its tenants the
service they were given there (VTC). Alone, a router orders a band's tenants by that only, so a
tenant spreading its requests over two routers got about 3/4 of the engines against a tenant
using one (one router all its, the other split evenly), and 50/50 only where both were sent
to the same router.

**The exchange** piggybacks on the router's existing report to the app's quota actor
(:meth:`serve_app.governance.cluster_quota.ClusterQuota._report`, every ``FLUSH_S``, off the
request path: no request ever waits on it, none makes a call). The router (:class:`FairShareSync`)
sends, per model and tenant, its *cumulative* service since it started (idempotent: a report
sent twice, or abandoned on a time-out and run by the actor later, counts once), and the actor's
:class:`ServiceTable` answers, per model and tenant, the service of every other router (and
of routers gone since), which the queue adds to its own (:meth:`FairQueue.set_remote`). So a
router's view is at most one report (plus the other routers' report period) old. The queue's
semantics stay: a tenant newly backlogged is lifted to its band's floor (on the app-wide sum),
bands are strict.

**Failure rule** (the cluster quota's, :mod:`serve_app.governance.quota_link`): when the actor
is slow or gone, the report is given up after ``CALL_TIMEOUT_S`` in the background; the queues
keep the others' service as last reported and go on charging their own (the local view, no
wait, no error). The first report answered after it carries the router's whole cumulative, so
the actor's totals and every router's view are reconciled at once.

**Actor restarts.** The table is checkpointed with the quota actor's buckets (at most every
``CHECKPOINT_S``); an actor that restores it keeps its epoch, and routers go on as before. Where
no checkpoint could be read, the new table has a new epoch: each router's next report counts
its whole cumulative, so the totals come back within one report but without the service of
routers that are gone. That is acceptable: fair share is relative among the tenants backlogged
now, the service lost is that of routers no longer serving anyone, and a queue moves each
tenant by what it is told, so a tenant served mostly there gains at most that old service as
credit once, as with a router restart before this existed.

**A router silent for** ``ROUTER_TTL_S`` (dead, or cut off) is dropped from the table, its
service kept in the totals (it was given). If it reports again, it sends the cumulative the
actor last acknowledged (``base``): the actor counts only what came since, never twice.

Pure Python (no Ray): the actor (:class:`~serve_app.governance.quota_state.QuotaState`) holds a
:class:`ServiceTable`, the router's :class:`~serve_app.governance.cluster_quota.ClusterQuota` a
:class:`FairShareSync`; unit tests run both in-process.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Callable, Mapping, Protocol

# A router that has not reported for this long is taken for gone (its entries are dropped; the
# service it gave stays in the totals).
ROUTER_TTL_S = 60.0

# model -> tenant -> service
Service = dict[str, dict[str, float]]


class ServiceQueue(Protocol):
    """A model's fair queue as the exchange uses it (:class:`~serve_app.governance.fair_queue.
    FairQueue`; a FIFO queue's methods do nothing)."""

    def __len__(self) -> int: ...

    def charged(self) -> dict[str, float]: ...

    def set_remote(self, service: Mapping[str, float]) -> None: ...


class FairShareSync:
    """One router replica's side: which queues it shares, what it sends, what it does with the
    answer. Single-threaded (the router's event loop); never awaits."""

    def __init__(self, router_id: str | None = None) -> None:
        self.router_id = router_id or uuid.uuid4().hex  # a restarted replica is a new one
        self._queues: dict[str, ServiceQueue] = {}
        self._epoch: str | None = None  # the actor table's epoch at the last answer
        self._acked: Service = {}       # the cumulative the actor last acknowledged
        self.answers = 0                # answers applied (for tests and status)

    def attach(self, queues: Mapping[str, ServiceQueue]) -> None:
        """Share these models' queues (model name -> its fair queue)."""
        self._queues.update(queues)

    def outgoing(self) -> dict[str, Any] | None:
        """The report to send now: this router's cumulative service per model and tenant, with
        the epoch and figures the actor last acknowledged; None when there is nothing to send
        or learn (nothing charged since the last answer and no request waiting here)."""
        if not self._queues:
            return None
        now = {m: q.charged() for m, q in self._queues.items()}
        now = {m: s for m, s in now.items() if s}
        if now == self._acked and not any(len(q) for q in self._queues.values()):
            return None
        return {"router": self.router_id, "epoch": self._epoch, "base": self._acked,
                "service": now}

    def answered(self, sent: Mapping[str, Any], answer: Mapping[str, Any]) -> None:
        """The actor's answer to ``sent``: the others' service, applied to each queue."""
        self._epoch = answer["epoch"]
        self._acked = sent["service"]
        others: Service = answer["others"]
        for model, queue in self._queues.items():
            queue.set_remote(others.get(model, {}))
        self.answers += 1


class ServiceTable:
    """The actor's side: every router's cumulative service per model and tenant, and the
    totals. ``clock``: wall time (the checkpoint outlives the process)."""

    def __init__(self, clock: Callable[[], float] = time.time,
                 state: Mapping[str, Any] | None = None) -> None:
        """``state``: a :meth:`state` to restore (a checkpoint): same epoch, same totals, its
        routers taken as just seen."""
        self.clock = clock
        self.epoch: str = uuid.uuid4().hex
        self._total: Service = {}
        self._routers: dict[str, tuple[float, Service]] = {}
        if state:
            self.epoch = state["epoch"]
            self._total = {m: dict(s) for m, s in state["total"].items()}
            now = clock()
            self._routers = {r: (now, s) for r, s in state["routers"].items()}

    def state(self) -> dict[str, Any]:
        """JSON-ready, for the checkpoint."""
        return {"epoch": self.epoch, "total": self._total,
                "routers": {r: s for r, (_, s) in self._routers.items()}}

    def report(self, router: str, epoch: str | None, base: Service, service: Service
               ) -> dict[str, Any]:
        """Router ``router`` has given ``service`` in all (cumulative; ``base``: what it was
        told this table acknowledged, in ``epoch``). Returns this table's ``epoch`` and the
        ``others``: per model and tenant, every other router's service (and gone routers')."""
        now = self.clock()
        held = self._routers.get(router)
        # An unknown router: new (nothing counted yet), or dropped as silent while this table
        # already counted up to its ``base`` (same epoch): count only what came since.
        known = held[1] if held is not None else (base if epoch == self.epoch else {})
        for model in set(known) | set(service):
            mine, was = service.get(model, {}), known.get(model, {})
            total = self._total.setdefault(model, {})
            for tenant in set(mine) | set(was):
                total[tenant] = total.get(tenant, 0.0) + mine.get(tenant, 0.0) \
                    - was.get(tenant, 0.0)
        self._routers[router] = (now, {m: dict(s) for m, s in service.items()})
        for r in [r for r, (seen, _) in self._routers.items() if now - seen > ROUTER_TTL_S]:
            del self._routers[r]
        others: Service = {}
        for model, total in self._total.items():
            mine = service.get(model, {})
            out = {t: round(v - mine.get(t, 0.0), 3) for t, v in total.items()}
            others[model] = {t: v for t, v in out.items() if v}
        return {"epoch": self.epoch, "others": others}
