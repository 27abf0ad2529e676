"""Guards for every private Ray Serve API the project uses (serve_app/serve_private.py).

Each test names the private API it guards and checks what the project relies on it to do, on
Ray's own classes (built without a cluster): when a Ray upgrade moves one or changes what it
does, the test that fails says which, before a deploy does. The live behaviour behind
``with_version`` (a router-only change leaves the engine replicas alone) is checked on a real
stack in tests/integration/test_live_config.py."""

from __future__ import annotations

import asyncio
import inspect
import time
from types import SimpleNamespace

import pytest
from ray import serve
from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RunningReplicaInfo,
)
from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.replica_wrapper import (
    ActorReplicaWrapper,
    RunningReplica,
    gRPCReplicaWrapper,
)
from ray.serve.handle import DeploymentHandle

from serve_app import serve_private

DEPLOYMENT = DeploymentID(name="LLMServer", app_name="app")


class _Info(RunningReplicaInfo):
    """Serve's record of a running replica, whose actor handle needs no cluster."""

    def get_actor_handle(self) -> SimpleNamespace:
        return SimpleNamespace(_actor_id="actor")


class _Replica(RunningReplica):
    """Serve's own replica wrapper; its queue length answers after ``delay_s`` (or raises)."""

    def __init__(self, uid: str, queue_len: int | None = 0, delay_s: float = 0.0) -> None:
        super().__init__(_Info(replica_id=ReplicaID(unique_id=uid, deployment_id=DEPLOYMENT),
                               node_id="node", node_ip="127.0.0.1", availability_zone=None,
                               actor_name=f"actor-{uid}", max_ongoing_requests=8, port=1))
        self.queue_len, self.delay_s, self.deadlines = queue_len, delay_s, []

    async def get_queue_len(self, *, deadline_s: float) -> int:
        self.deadlines.append(deadline_s)
        await asyncio.sleep(self.delay_s)
        if self.queue_len is None:
            raise RuntimeError("replica unavailable")
        return self.queue_len


def _handle() -> DeploymentHandle:
    """A real DeploymentHandle whose Serve router is a stand-in (no Serve running)."""
    return DeploymentHandle(DEPLOYMENT.name, DEPLOYMENT.app_name,
                            _create_router=lambda **_: SimpleNamespace())


def _transport(handle: DeploymentHandle) -> type:
    """The replica wrapper Serve sends ``handle``'s calls through: Serve turns the handle's
    options into the request's metadata and picks the wrapper by it."""
    _, metadata = handle._init_router_and_get_metadata()

    async def pick() -> type:  # PendingRequest makes its future on the running loop
        pending = PendingRequest(args=[], kwargs={}, metadata=metadata)
        return type(_Replica("r")._get_replica_wrapper(pending))

    return asyncio.run(pick())


@pytest.mark.parametrize("grpc_plane", [True, False])
def test_private_by_reference_selects_the_transport_of_this_data_plane(monkeypatch,
                                                                        grpc_plane):
    """``DeploymentHandle.options(_by_reference=...)``: False sends the calls over gRPC
    (``gRPCReplicaWrapper``), True as Ray actor calls. The driver (Serve imported before the
    throughput-optimized environment) builds handles for actor calls; in a router on the gRPC
    data plane they used to stay actor calls (1.9-2.2 ms against 0.9-1.1 ms a first item)."""
    built_in_driver = _handle().options(_by_reference=True)
    assert _transport(built_in_driver) is ActorReplicaWrapper
    assert not serve_private.uses_grpc(built_in_driver)
    monkeypatch.setattr(serve_private, "RAY_SERVE_USE_GRPC_BY_DEFAULT", grpc_plane)
    handle = serve_private.on_data_plane(built_in_driver)
    assert serve_private.uses_grpc(handle) is grpc_plane
    assert _transport(handle) is (gRPCReplicaWrapper if grpc_plane else ActorReplicaWrapper)
    assert _transport(handle.options(stream=True)) is _transport(handle)  # options keep it


def test_private_grpc_default_is_what_new_handles_use():
    """``RAY_SERVE_USE_GRPC_BY_DEFAULT`` is the transport a handle built in this process gets
    (what :func:`on_data_plane` restores in the router replica)."""
    from ray.serve._private import constants

    assert serve_private.RAY_SERVE_USE_GRPC_BY_DEFAULT is constants.RAY_SERVE_USE_GRPC_BY_DEFAULT
    assert serve_private.uses_grpc(_handle()) is constants.RAY_SERVE_USE_GRPC_BY_DEFAULT


def test_private_deployment_options_internal_version_still_sets_the_version():
    """``Deployment.options(_internal=True, version=...)``: the public path refuses versions."""

    @serve.deployment
    class D:
        pass

    assert serve_private.with_version(D, "v-123").version == "v-123"


def test_private_handle_init_run_router_in_separate_loop_still_exists():
    """``DeploymentHandle._init(_run_router_in_separate_loop=True)``."""
    import dataclasses

    from ray.serve._private.handle_options import InitHandleOptions

    assert hasattr(serve.handle.DeploymentHandle, "_init")
    assert "_run_router_in_separate_loop" in {f.name for f in dataclasses.fields(InitHandleOptions)}
    assert InitHandleOptions.create(_run_router_in_separate_loop=True)._run_router_in_separate_loop
    assert hasattr(serve.handle.DeploymentHandle, "is_initialized")


def test_private_pow_2_router_still_has_choose_replicas():
    """``ray.serve._private.request_router.pow_2_router.PowerOfTwoChoicesRequestRouter``."""
    from ray.serve.request_router import RequestRouter

    router = serve_private.PowerOfTwoChoicesRequestRouter
    assert issubclass(router, RequestRouter)
    assert list(inspect.signature(router.choose_replicas).parameters)[:3] == [
        "self", "candidate_replicas", "pending_request"]


def test_private_internal_kv_functions_still_exist():
    """``ray.experimental.internal_kv._internal_kv_put/_get/_list/_del`` with a namespace."""
    from ray.experimental import internal_kv

    for name in ("_internal_kv_put", "_internal_kv_get", "_internal_kv_list", "_internal_kv_del"):
        assert "namespace" in inspect.signature(getattr(internal_kv, name)).parameters, name


def test_private_broadcast_response_fetch_and_replica_result_get_async_still_exist():
    """``DeploymentBroadcastResponse._fetch_replica_results_async`` and
    ``ReplicaResult.get_async`` (broadcast_each bounds each replica's answer on its own)."""
    from ray.serve._private.replica_result import ReplicaResult
    from ray.serve.handle import DeploymentBroadcastResponse

    assert inspect.iscoroutinefunction(DeploymentBroadcastResponse._fetch_replica_results_async)
    assert inspect.iscoroutinefunction(ReplicaResult.get_async)
    assert "method_name" in inspect.signature(serve.handle.DeploymentHandle.broadcast).parameters


def _router(cls: type | None = None, **kwargs: float):
    cls = cls or serve_private.PowerOfTwoChoicesRequestRouter
    return cls(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN, **kwargs)


def test_private_probe_queue_lens_answers_each_replica_within_serves_deadline():
    """``RequestRouter._probe_queue_lens(replicas, backoff_index)``: each replica's queue
    length, None for one that is late past Serve's response deadline or fails, the answers put
    in the router's queue-length cache (the prefix-affinity policy reads loads from the cache
    and probes those it lacks)."""
    async def probe() -> tuple[dict[str, int | None], float, object]:
        router = _router()
        fast, slow, failing = _Replica("fast", 3), _Replica("slow", 1, 5.0), _Replica("x", None)
        t0 = time.monotonic()
        answers = await serve_private.probe_queue_lens(router, [fast, slow, failing])
        took = time.monotonic() - t0
        assert await serve_private.probe_queue_lens(router, []) == []
        deadline = router.queue_len_response_deadline_s
        assert slow.deadlines == [deadline]  # backoff index 0: Serve's first deadline
        cache = router.replica_queue_len_cache
        assert cache.get(fast.replica_id) == 3 and cache.get(slow.replica_id) is None
        return {r.replica_id.unique_id: n for r, n in answers}, took, deadline

    answers, took, deadline = asyncio.run(probe())
    assert answers == {"fast": 3, "slow": None, "x": None}
    assert deadline <= took < deadline + 1.0  # bounded by the deadline, not the slow replica


class _RankingRouter(serve_private.PowerOfTwoChoicesRequestRouter):
    """Offers its one replica on every ask, asking for a backoff when ``backoff``."""

    backoff = False

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if self.backoff:
            serve_private.request_backoff(pending_request)
        return [list(candidate_replicas)]


def _three_asks(backoff: bool, initial_backoff_s: float) -> float:
    """Seconds Serve's routing loop takes to ask the router three times for one request whose
    replica refused it each time."""
    async def run() -> float:
        router = _router(_RankingRouter, initial_backoff_s=initial_backoff_s)
        router.backoff = backoff
        router.update_replicas([_Replica("only")])
        pending = PendingRequest(args=[], kwargs={},
                                 metadata=_handle()._init_router_and_get_metadata()[1])
        assert pending.routing_context.should_backoff is False  # Serve's default
        asks = router._choose_replicas_with_backoff(pending)
        t0 = time.monotonic()
        for _ in range(3):
            assert [r.replica_id.unique_id for r in await asks.__anext__()] == ["only"]
        took = time.monotonic() - t0
        await asks.aclose()
        return took

    return asyncio.run(run())


def test_private_should_backoff_makes_serves_routing_loop_back_off():
    """``PendingRequest.routing_context.should_backoff`` (:func:`request_backoff`): a request
    router that offered every candidate and was refused sets it, and Serve's routing loop
    (``_choose_replicas_with_backoff``) then waits ``initial_backoff_s`` before its third ask;
    unset, Serve asks again at once (a busy loop while every replica is full)."""
    assert _three_asks(backoff=True, initial_backoff_s=0.5) >= 0.45
    assert _three_asks(backoff=False, initial_backoff_s=0.5) < 0.3


def test_private_replica_placement_group_names_and_infeasible_state_still_read_back(
        monkeypatch):
    """``replica_placement_groups`` finds a deployment's replica groups by the name Serve gives
    them (the replica actor's, ``ReplicaID.to_full_id_str``, passed as the group's name by the
    deployment scheduler) and reads ``stats.scheduling_state`` (INFEASIBLE) from the table
    entry ``GlobalState._gen_placement_group_info`` builds of the GCS's record."""
    import ray.util
    from ray._private.state import GlobalState
    from ray.core.generated import gcs_pb2
    from ray.serve._private import deployment_scheduler, deployment_state

    rid = ReplicaID(unique_id="abc", deployment_id=DEPLOYMENT)
    name = rid.to_full_id_str()
    assert "self._actor_name = replica_id.to_full_id_str()" in inspect.getsource(
        deployment_state), "Serve no longer names replica actors by ReplicaID.to_full_id_str"
    assert 'name=scheduling_request.actor_options["name"]' in inspect.getsource(
        deployment_scheduler), "Serve no longer names a replica's placement group after it"
    data = gcs_pb2.PlacementGroupTableData(
        placement_group_id=b"\x01" * 18, name=name,
        state=gcs_pb2.PlacementGroupTableData.PENDING,
        stats=gcs_pb2.PlacementGroupStats(
            scheduling_state=gcs_pb2.PlacementGroupStats.INFEASIBLE))
    data.bundles.add().unit_resources["CPU"] = 64.0
    entry = GlobalState()._gen_placement_group_info(data)
    other = dict(entry, name=ReplicaID(unique_id="x", deployment_id=DeploymentID(
        name="Router", app_name="app")).to_full_id_str())
    monkeypatch.setattr(ray.util, "placement_group_table",
                        lambda *_: {"1": entry, "2": other, "3": dict(entry, name="mine")})
    groups = serve_private.replica_placement_groups("app", "LLMServer")
    assert [g["name"] for g in groups] == [name]
    assert groups[0]["state"] == "PENDING"
    assert groups[0]["stats"]["scheduling_state"] == "INFEASIBLE"
    assert list(groups[0]["bundles"].values()) == [{"CPU": 64.0}]


def test_private_autoscaler_cluster_config_still_lists_node_types(monkeypatch):
    """``autoscaler_node_types`` reads the v2 autoscaler's node types from
    ``GlobalState.get_cluster_config`` (an ``autoscaler_pb2.ClusterConfig``)."""
    import ray._private.state
    from ray.core.generated import autoscaler_pb2

    config = autoscaler_pb2.ClusterConfig()
    group = config.node_group_configs.add(max_count=2)
    group.resources["GPU"] = 1
    config.node_group_configs.add(max_count=0).resources["CPU"] = 8
    monkeypatch.setattr(ray._private.state.state, "get_cluster_config", lambda: config)
    assert serve_private.autoscaler_node_types() == [{"GPU": 1.0}]
    monkeypatch.setattr(ray._private.state.state, "get_cluster_config", lambda: None)
    assert serve_private.autoscaler_node_types() is None
