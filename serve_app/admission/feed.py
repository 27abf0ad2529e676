"""The router's view of one model's engines: polls every live replica's load and turns it into
the model's admission capacity (and reports the router's backlog to the replicas, which pass it
on to the autoscaler).

One poll is one ``broadcast`` of ``LLMServer.engine_load`` (a few integers back from each
replica). It runs every ``poll_interval_s`` while the model has requests in flight, at once when
requests start to queue, and every ``idle_poll_interval_s`` otherwise. Nothing here is on the
per-token path: requests are admitted and released by the admission controller as they arrive
and end; the feed only moves the limit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Sequence

from ray.serve.handle import DeploymentHandle

from serve_app.config import AdmissionSettings
from serve_app.admission.controller import AdmissionController
from serve_app.admission.policy import CapacityPolicy
from serve_app.engine.protocol import EngineLoad

logger = logging.getLogger(__name__)

POLL_TIMEOUT_S = 2.0


class EngineFeed:
    """Keeps ``admission.capacity`` in step with the live replicas of ``model``."""

    def __init__(self, model: str, handle: DeploymentHandle, admission: AdmissionController,
                 policy: CapacityPolicy, settings: AdmissionSettings, num_routers: int,
                 router_id: str,
                 on_poll: Callable[[str, Sequence[EngineLoad], int], None] | None = None
                 ) -> None:
        self.model = model
        self.handle = handle
        self.admission = admission
        self.policy = policy
        self.settings = settings
        self.num_routers = num_routers
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
        """The live replicas' loads, or None when the poll failed or timed out (the previous
        view then stands: a slow answer must not look like a model without replicas)."""
        response = self.handle.broadcast("engine_load", self.router_id,
                                         self.admission.queued())
        try:
            results = await asyncio.wait_for(
                response.results_async(return_exceptions=True), POLL_TIMEOUT_S)
        except Exception as err:  # timeout, deployment being redeployed, ...
            self._failures += 1
            if self._failures in (1, 10) or self._failures % 100 == 0:
                logger.warning("load poll of %s failed (%d in a row): %r", self.model,
                               self._failures, err)
            return None
        self._failures = 0
        # A replica that raised (dying, or stopping) is not live for admission.
        return [r for r in results if isinstance(r, EngineLoad)]

    def apply(self, replicas: list[EngineLoad]) -> int:
        """Set the admission capacity from ``replicas``; returns it."""
        self.replicas = replicas
        self.polled_at = time.monotonic()
        capacity = self.policy.capacity(replicas, self.num_routers)
        self.admission.set_capacity(capacity)
        if not replicas:  # cold start: bound how long a request waits for the first replica
            self.admission.expire_waiting(self.settings.cold_start_timeout_s)
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
