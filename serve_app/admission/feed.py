"""The router's view of one model's engines: polls every live replica's load and turns it into
this router's admission capacity for the model (and reports the router's demand to the
replicas, which pass the backlog on to the autoscaler and every router's demand back to the
routers).

One poll is one call of ``LLMServer.engine_load`` on every replica Serve's handle knows (a few
integers back from each). The answers in hand after ``ANSWER_DEADLINE_S`` make the view; a
replica that answered none of the polls of the last ``POLL_TIMEOUT_S`` drops out of it, and
until then its last answer stands in (its work keeps counting: a replica that flapped out of
the view for one late answer would let the routers admit its in-flight work again). So one slow
replica neither freezes the others' view (with one gather over all answers, every poll took
the slow one's timeout: views fell from 48 to 15 a second, bench/RESULTS.md 27) nor takes its
own work out of the count. A model with no replica has an empty view: its
requests wait in the fair queue, one goes through to wake Serve's autoscaler
(:data:`~serve_app.admission.policy.COLD_START_PROBE`), and after ``cold_start_timeout_s``
they are answered 503. The poll runs every :meth:`EngineFeed.busy_period` while the model has
requests in flight (``poll_interval_s``, longer with many routers so that each replica answers
at most ``engine_polls_per_s`` polls a second), at once when requests start to queue, and
every ``idle_poll_interval_s`` otherwise.
Nothing here is on the per-token path: requests are admitted and released by the admission
controller as they arrive and end; the feed only moves the limit and the view.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Sequence

from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from serve_app.admission.controller import AdmissionController
from serve_app.admission.policy import CapacityPolicy
from serve_app.admission.share import share_of
from serve_app.config import AdmissionSettings
from serve_app.engine.protocol import EngineLoad
from serve_app.serve_private import broadcast_each

logger = logging.getLogger(__name__)

POLL_TIMEOUT_S = 2.0  # a replica silent this long is not live for admission
# Answers wait together this long; a replica's engine_load is a few integers from its event
# loop (about a millisecond), so only a stuck or overloaded replica misses it.
ANSWER_DEADLINE_S = 0.25
# The busy poll period never grows past this: the simulation (bench/RESULTS.md 27d) holds every
# admission bar at 8 x 32 and 64 x 256 with 0.1 s views; at 0.25 s, 64 x 256 let the engines'
# waiting pass the headroom and a scale-up's worst second fall to 94%. Beyond 5 routers per
# model a replica then answers more than engine_polls_per_s (64 routers: about 0.9 of a core,
# 27b); pushing the load on the output channels is the way past that.
BUSY_PERIOD_CAP_S = 0.1


class EngineFeed:
    """Keeps ``admission.capacity`` and its view in step with the live replicas of ``model``."""

    def __init__(self, model: str, handle: DeploymentHandle, admission: AdmissionController,
                 policy: CapacityPolicy, settings: AdmissionSettings, router_id: str,
                 on_poll: Callable[[str, Sequence[EngineLoad], int], None] | None = None
                 ) -> None:
        self.model = model
        self.handle = handle
        self.admission = admission
        self.policy = policy
        self.settings = settings
        self.router_id = router_id
        self.replicas: list[EngineLoad] = []  # as of the last successful poll
        self.polled_at = 0.0
        self._on_poll = on_poll or (lambda *_: None)
        self._task: asyncio.Task[None] | None = None
        self._failures = 0
        self._answered: dict[str, tuple[EngineLoad, float]] = {}  # replica -> last answer, when
        self.held = 0  # answers stood in for a late replica, since start (admission_state)

    def start(self) -> None:
        """Start polling on the running event loop (idempotent)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def poll(self) -> list[EngineLoad] | None:
        """The view of one poll (:meth:`view_of`; [] when the model has no replica), or None
        when the poll itself failed (the previous view then stands)."""
        a = self.admission
        try:
            results = await broadcast_each(self.handle, "engine_load", self.router_id,
                                           a.queued(), a.in_flight, timeout_s=POLL_TIMEOUT_S,
                                           answer_timeout_s=ANSWER_DEADLINE_S)
        except DeploymentUnavailableError:  # no replica: an empty view, not a stale one
            self._failures = 0
            self._answered.clear()
            return []
        except Exception as err:  # the deployment being redeployed, a poll that hung, ...
            self._failures += 1
            if self._failures in (1, 10) or self._failures % 100 == 0:
                logger.warning("load poll of %s failed (%d in a row): %r", self.model,
                               self._failures, err)
            return None
        self._failures = 0
        # A replica that raised (dying, stopping) is not live for admission; one that was
        # late may be for a while.
        late = sum(isinstance(r, asyncio.TimeoutError) for r in results)
        return self.view_of([r for r in results if isinstance(r, EngineLoad)], late,
                            time.monotonic())

    def busy_period(self) -> float:
        """The poll period while the model has work: ``poll_interval_s``, or longer (up to
        ``BUSY_PERIOD_CAP_S``) when the routers that reported to the replicas (the last view's
        demands) would together poll each replica more than ``engine_polls_per_s`` times a
        second. Admission itself does not wait for a poll: a finished request frees its place
        at once."""
        routers = max((len(r.router_demand) for r in self.replicas[:1]), default=1)
        return max(self.settings.poll_interval_s,
                   min(BUSY_PERIOD_CAP_S, routers / self.settings.engine_polls_per_s))

    def view_of(self, answers: list[EngineLoad], late: int, now: float) -> list[EngineLoad]:
        """The view from one poll at ``now``: every replica that answered, then the last answer
        of up to ``late`` replicas that were in the view, did not answer this time and did
        answer within ``POLL_TIMEOUT_S`` (the most recent first). A broadcast's late answers
        carry no replica id; a replica Serve took out of its set is not called, so it is not
        among the ``late`` and drops out at once."""
        for load in answers:
            self._answered[load.replica] = (load, now)
        answered = {load.replica for load in answers}
        missing = sorted(((load, at) for rid, (load, at) in self._answered.items()
                          if rid not in answered and now - at <= POLL_TIMEOUT_S),
                         key=lambda item: -item[1])[:late]
        self._answered = {load.replica: (load, at) for load, at in missing} | {
            rid: self._answered[rid] for rid in answered}
        self.held += len(missing)
        return answers + [load for load, _ in missing]

    def apply(self, replicas: list[EngineLoad]) -> int:
        """Set this router's admission capacity and view from ``replicas``; returns it."""
        self.replicas = replicas
        self.polled_at = time.monotonic()
        a = self.admission
        total = self.policy.capacity(replicas)
        capacity = share_of(total, replicas, self.router_id, a.in_flight + a.queued())
        a.set_capacity(capacity, live=[r.replica for r in replicas])
        if not replicas:  # cold start: bound how long a request waits for the first replica
            a.expire_waiting(self.settings.cold_start_timeout_s)
        self._on_poll(self.model, replicas, capacity)
        return capacity

    async def _run(self) -> None:
        while True:
            try:
                replicas = await self.poll()
                if replicas is not None:
                    self.apply(replicas)
                elif not self.replicas:  # no answer and none known: still a cold start
                    self.admission.expire_waiting(self.settings.cold_start_timeout_s)
                a = self.admission
                if a.in_flight or len(a.queue):
                    await asyncio.sleep(self.busy_period())
                else:  # idle: wake on the next queue (a burst) or the idle timer
                    try:
                        await asyncio.wait_for(a.blocked.wait(),
                                               self.settings.idle_poll_interval_s)
                    except asyncio.TimeoutError:
                        pass
            except asyncio.CancelledError:
                raise
            except Exception:  # never let the feed die: admission would freeze
                logger.exception("engine feed of %s failed; retrying", self.model)
                await asyncio.sleep(self.settings.idle_poll_interval_s)
