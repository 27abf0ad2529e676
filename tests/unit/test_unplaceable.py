"""A model whose replica cannot be placed fails fast (issue 41 item 7): the decision on the
cluster's facts (serve_app/admission/feed.py ``cannot_place``), the engine feed that checks it
while requests wait for a cold model, and the 503 of the request sent to wake it. Before, both
the queued requests and the one sent to Serve waited out ``cold_start_timeout_s`` (600 s)."""

from __future__ import annotations

import asyncio
import time

import pytest
from ray.serve.exceptions import DeploymentUnavailableError

from serve_app.admission.controller import AdmissionController, NoReplicaInTime
from serve_app.admission.feed import EngineFeed, PlacementFacts, cannot_place
from serve_app.admission import capacity_policy
from serve_app.config import AdmissionSettings
from serve_app.ingress.engine_stream import first_chunk_of_cold_start
from serve_app.ingress.errors import OpenAIError

NODE = {"CPU": 2.0, "memory": 8e9, "node:127.0.0.1": 1.0}


def _group(bundles: list[dict[str, float]], scheduling: str = "INFEASIBLE",
           state: str = "PENDING", strategy: str = "PACK") -> dict[str, object]:
    """One entry of ``ray.util.placement_group_table()``, as Serve's replica groups read."""
    return {"name": "SERVE_REPLICA::app#LLMServer_m#abc", "state": state, "strategy": strategy,
            "bundles": dict(enumerate(bundles)), "stats": {"scheduling_state": scheduling}}


def test_an_infeasible_group_on_a_fixed_cluster_cannot_be_placed_and_says_why() -> None:
    reason = cannot_place(PlacementFacts([_group([{"CPU": 64.0}])], [NODE, NODE], None))
    assert reason is not None
    assert "64 CPU" in reason and "largest node has 2 CPU" in reason, reason
    assert "4 CPU in 2 node(s)" in reason, reason


def test_a_group_waiting_for_resources_in_use_is_not_unplaceable() -> None:
    """NO_RESOURCES: it fits a node, which is busy now (a replica stopping frees it)."""
    for scheduling in ("NO_RESOURCES", "QUEUED", "SCHEDULING_STARTED", "FINISHED"):
        assert cannot_place(PlacementFacts([_group([{"CPU": 1.0}], scheduling)], [NODE],
                                           None)) is None
    # A created group (its replica is starting: loading weights) is not in question.
    assert cannot_place(PlacementFacts([_group([{"CPU": 64.0}], state="CREATED")], [NODE],
                                       None)) is None
    assert cannot_place(PlacementFacts([], [NODE], None)) is None


def test_an_autoscaler_that_may_add_a_node_that_fits_keeps_the_request_waiting() -> None:
    gpu_node = {"CPU": 8.0, "GPU": 1.0}
    group = _group([{"CPU": 1.0, "GPU": 1.0}])
    assert cannot_place(PlacementFacts([group], [NODE], [gpu_node])) is None
    # One whose node types cannot hold it: fail fast, and say the autoscaler cannot help.
    reason = cannot_place(PlacementFacts([_group([{"CPU": 1.0, "GPU": 2.0}],
                                                 strategy="STRICT_PACK")], [NODE], [gpu_node]))
    assert reason is not None and "autoscaler" in reason and "2 GPU" in reason, reason
    # PACK spreads bundles over nodes: two 1-GPU bundles fit two 1-GPU nodes.
    assert cannot_place(PlacementFacts([_group([{"CPU": 1.0, "GPU": 1.0}, {"GPU": 1.0}])],
                                       [NODE], [gpu_node])) is None


class _NoReplica:
    """A model's handle while it has no replica."""

    app_name, deployment_name = "app", "LLMServer_m"


async def _broadcast_none(*_args: object, **_kwargs: object) -> list[object]:
    raise DeploymentUnavailableError(None)  # type: ignore[arg-type]


def _feed(facts: PlacementFacts | None, monkeypatch: pytest.MonkeyPatch
          ) -> tuple[EngineFeed, AdmissionController, list[float]]:
    monkeypatch.setattr("serve_app.admission.feed.broadcast_each", _broadcast_none)
    checks: list[float] = []

    async def placement() -> PlacementFacts | None:
        checks.append(time.monotonic())
        return facts

    admission = AdmissionController(1, 100)
    settings = AdmissionSettings(poll_interval_s=0.01, cold_start_timeout_s=600)
    feed = EngineFeed("m", _NoReplica(), admission,  # type: ignore[arg-type]
                      capacity_policy("engine_feedback", headroom=4, kv_cache_high=0.95,
                                      fixed_per_replica=8, upper_bound=None),
                      settings, "r1", placement=placement)
    return feed, admission, checks


def test_an_unplaceable_model_answers_its_waiting_and_sent_requests_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The request sent to wake the model (waiting on Serve) and the one queued behind it both
    get the 503 within a check, not after ``cold_start_timeout_s``."""
    feed, admission, checks = _feed(
        PlacementFacts([_group([{"CPU": 64.0}])], [NODE], None), monkeypatch)

    async def main() -> tuple[BaseException | None, BaseException | None, float]:
        t0 = time.monotonic()
        await admission.acquire("t", "normal")  # the probe: sent to Serve, which never starts it
        never: asyncio.Future[object] = asyncio.get_running_loop().create_future()

        class _Gen:
            def __anext__(self) -> asyncio.Future[object]:
                return never

        sent = asyncio.ensure_future(first_chunk_of_cold_start(
            _Gen(), "m", t0, 600, feed))  # type: ignore[arg-type]
        queued = asyncio.ensure_future(admission.acquire("u", "normal"))
        feed.start()
        results = await asyncio.wait_for(asyncio.gather(sent, queued, return_exceptions=True),
                                         5)
        return results[0], results[1], time.monotonic() - t0

    sent, queued, took = asyncio.run(main())
    assert isinstance(sent, OpenAIError) and sent.status_code == 503, sent
    assert "cannot be placed" in sent.message and "64 CPU" in sent.message, sent.message
    assert sent.headers and "Retry-After" in sent.headers
    assert isinstance(queued, NoReplicaInTime) and queued.reason and "64 CPU" in queued.reason
    assert took < 2.0 and len(checks) == 1, (took, checks)


def test_a_placeable_model_that_is_loading_keeps_its_requests_waiting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Its group is created (the replica loads its weights): requests wait; the check runs at
    most every PLACEMENT_CHECK_PERIOD_S, and not at all once nobody waits."""
    feed, admission, checks = _feed(
        PlacementFacts([_group([{"CPU": 1.0}], "FINISHED", "CREATED")], [NODE], None),
        monkeypatch)

    async def main() -> tuple[bool, int]:
        await admission.acquire("t", "normal")
        queued = asyncio.ensure_future(admission.acquire("u", "normal"))
        feed.start()
        await asyncio.sleep(2.5)
        waiting = not queued.done()
        queued.cancel()
        admission.release("t", 0.0)
        await asyncio.sleep(1.5)  # nobody waits: no more checks
        n = len(checks)
        await asyncio.sleep(1.5)
        return waiting and len(checks) == n and feed.unplaceable is None, n

    ok, n = asyncio.run(main())
    assert ok and 2 <= n <= 4, n


def test_a_cold_request_without_a_verdict_still_times_out_at_cold_start_timeout() -> None:
    async def main() -> OpenAIError:
        never: asyncio.Future[object] = asyncio.get_running_loop().create_future()

        class _Gen:
            def __anext__(self) -> asyncio.Future[object]:
                return never

        try:
            await first_chunk_of_cold_start(_Gen(), "m", time.monotonic(),  # type: ignore
                                            0.2, None)
        except OpenAIError as err:
            return err
        raise AssertionError("no 503")

    err = asyncio.run(main())
    assert err.status_code == 503 and "within 0.2 s" in err.message
