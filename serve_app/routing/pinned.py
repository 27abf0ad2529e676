"""The LLMServer deployment's Serve request router: Serve's own power-of-two choice, except for
calls that name the replica they must reach.

A router replica opens its output channel (:mod:`serve_app.engine.channel`) on one specific
engine replica, the one serving its requests; Serve's handles have no call for that, but they
ask the deployment's request router where each call goes. A call with a ``target_replica``
keyword goes to that replica only, or waits while it is not a candidate (not yet running, or
stopping: the caller bounds the wait). Every other call (every request) is routed as Serve
routes it by default.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    RequestRouter,
    RunningReplica,
)

from serve_app.serve_private import PowerOfTwoChoicesRequestRouter

TARGET_KWARG = "target_replica"
ROUTER_CLASS = "serve_app.routing.pinned:PinnedOrPowerOfTwoRouter"


def pinned_target(pending_request: PendingRequest | None) -> str | None:
    """The replica id a call names in ``target_replica``, if any."""
    if pending_request is None:
        return None
    target: Any = pending_request.kwargs.get(TARGET_KWARG)
    return target if isinstance(target, str) else None


class PinnedOrPowerOfTwoRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Honours ``target_replica``; otherwise Serve's power-of-two choice.

    Serve's default router also has the FIFO mixin, which hands a chosen replica to the oldest
    waiting call, not to the call it was chosen for: a pinned call could then be sent to the
    replica chosen for another. Without it each call gets the replica chosen for it."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        target = pinned_target(pending_request)
        if target is not None:
            pinned = [r for r in candidate_replicas if r.replica_id.unique_id == target]
            return [pinned] if pinned else []
        return await PowerOfTwoChoicesRequestRouter.choose_replicas(
            self, candidate_replicas, pending_request)  # type: ignore[arg-type]
