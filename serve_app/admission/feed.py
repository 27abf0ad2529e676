"""The router's view of one model's engines: polls every live replica's load and turns it into
this router's admission capacity for the model (and reports the router's demand to the
replicas, which pass the backlog on to the autoscaler and every router's demand back to the
routers).

One poll is one call of ``LLMServer.engine_load`` on every replica Serve's handle knows (a few
integers back from each), each bounded on its own: a replica that does not answer within
``POLL_TIMEOUT_S`` drops out of this poll's view, and the others keep admitting (one slow
replica used to freeze the whole model's view). A model with no replica has an empty view: its
requests wait in the fair queue, one goes through to wake Serve's autoscaler
(:data:`~serve_app.admission.policy.COLD_START_PROBE`), and after ``cold_start_timeout_s``
they are answered 503. The poll runs every ``poll_interval_s`` while the model has requests in
flight, at once when requests start to queue, and every ``idle_poll_interval_s`` otherwise.
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

POLL_TIMEOUT_S = 2.0


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

    def start(self) -> None:
        """Start polling on the running event loop (idempotent)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def poll(self) -> list[EngineLoad] | None:
        """The loads of the replicas that answered in time ([] when the model has no replica),
        or None when the poll itself failed (the previous view then stands)."""
        a = self.admission
        try:
            results = await broadcast_each(self.handle, "engine_load", self.router_id,
                                           a.queued(), a.in_flight, timeout_s=POLL_TIMEOUT_S)
        except DeploymentUnavailableError:  # no replica: an empty view, not a stale one
            self._failures = 0
            return []
        except Exception as err:  # the deployment being redeployed, a poll that hung, ...
            self._failures += 1
            if self._failures in (1, 10) or self._failures % 100 == 0:
                logger.warning("load poll of %s failed (%d in a row): %r", self.model,
                               self._failures, err)
            return None
        self._failures = 0
        # A replica that raised or did not answer in time (dying, stopping, stuck) is not
        # live for admission.
        return [r for r in results if isinstance(r, EngineLoad)]

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
                    await asyncio.sleep(self.settings.poll_interval_s)
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
