"""The LLMServer's request router: calls that name a replica go there and nowhere else."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from serve_app.routing.pinned import TARGET_KWARG, PinnedOrPowerOfTwoRouter, pinned_target


def _replica(uid: str) -> SimpleNamespace:
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=uid))


def _choose(candidates: list, kwargs: dict) -> list:
    # The pinned path reads nothing of the router's state.
    return asyncio.run(PinnedOrPowerOfTwoRouter.choose_replicas(
        object(), candidates, SimpleNamespace(kwargs=kwargs)))  # type: ignore[arg-type]


def test_a_pinned_call_gets_its_replica_only():
    a, b, c = _replica("a"), _replica("b"), _replica("c")
    assert _choose([a, b, c], {TARGET_KWARG: "b"}) == [[b]]


def test_a_pinned_call_to_a_replica_that_is_not_a_candidate_waits():
    """Serve retries an empty choice with backoff: the call waits (the router bounds it)
    instead of reaching another replica, whose outbox is not its own."""
    assert _choose([_replica("a")], {TARGET_KWARG: "gone"}) == []


def test_an_unpinned_call_is_routed_as_serve_routes_it():
    """Every request (no ``target_replica``) goes through Serve's own power-of-two choice."""
    calls = []

    async def pow2(self, candidates, pending_request=None):
        calls.append([r.replica_id.unique_id for r in candidates])
        return [candidates[:1]]

    from serve_app.serve_private import PowerOfTwoChoicesRequestRouter

    original = PowerOfTwoChoicesRequestRouter.choose_replicas
    PowerOfTwoChoicesRequestRouter.choose_replicas = pow2  # type: ignore[method-assign]
    try:
        a, b = _replica("a"), _replica("b")
        assert _choose([a, b], {}) == [[a]]
    finally:
        PowerOfTwoChoicesRequestRouter.choose_replicas = original  # type: ignore[method-assign]
    assert calls == [["a", "b"]]


def test_only_a_string_target_pins():
    assert pinned_target(SimpleNamespace(kwargs={TARGET_KWARG: "r"})) == "r"
    assert pinned_target(SimpleNamespace(kwargs={TARGET_KWARG: 3})) is None
    assert pinned_target(SimpleNamespace(kwargs={})) is None
    assert pinned_target(None) is None


def test_the_router_has_no_fifo_mixin():
    """Serve's FIFO mixin hands a chosen replica to the oldest waiting call, which could send
    a pinned call to the replica chosen for another."""
    from ray.serve.request_router import FIFOMixin

    assert not issubclass(PinnedOrPowerOfTwoRouter, FIFOMixin)
