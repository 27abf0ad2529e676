"""Guards for every private Ray Serve API the project uses (serve_app/serve_private.py).

Each test names the private API it guards: when a Ray upgrade moves or changes one, the test
that fails says which, before a deploy does. The live behaviour behind ``with_version`` (a
router-only change leaves the engine replicas alone) is checked on a real stack in
tests/integration/test_live_config.py."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

from ray import serve

from serve_app import serve_private


class _Handle:
    """What serve_private touches of a DeploymentHandle for transports: options() and its
    _by_reference."""

    def __init__(self, by_reference: bool, stream: bool = False) -> None:
        self.handle_options = SimpleNamespace(_by_reference=by_reference, stream=stream)

    def options(self, **kwargs: bool) -> _Handle:
        o = self.handle_options
        return _Handle(kwargs.get("_by_reference", o._by_reference), kwargs.get("stream", o.stream))


def test_handles_built_in_the_driver_go_over_grpc_regression_router_used_actor_calls(
        monkeypatch):
    """The driver (Serve imported before the throughput-optimized environment) builds handles
    for Ray actor calls; in a router on the gRPC data plane they must go over gRPC."""
    built_in_driver = _Handle(by_reference=True)
    assert not serve_private.uses_grpc(built_in_driver)
    monkeypatch.setattr(serve_private, "RAY_SERVE_USE_GRPC_BY_DEFAULT", True)
    assert serve_private.uses_grpc(serve_private.on_data_plane(built_in_driver))


def test_without_the_grpc_data_plane_handles_stay_actor_calls(monkeypatch):
    monkeypatch.setattr(serve_private, "RAY_SERVE_USE_GRPC_BY_DEFAULT", False)
    assert not serve_private.uses_grpc(
        serve_private.on_data_plane(_Handle(by_reference=False)))


def test_private_handle_option_by_reference_still_exists():
    """``DeploymentHandle.options(_by_reference=...)`` and ``handle_options._by_reference``."""
    from ray.serve._private.handle_options import DynamicHandleOptions

    assert "_by_reference" in inspect.signature(serve.handle.DeploymentHandle.options).parameters
    assert hasattr(DynamicHandleOptions(), "_by_reference")
    assert isinstance(serve_private.RAY_SERVE_USE_GRPC_BY_DEFAULT, bool)


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


def test_private_request_router_probe_queue_lens_still_exists():
    """``RequestRouter._probe_queue_lens(replicas, backoff_index)``, a coroutine answering
    (replica, queue length or None) pairs (the prefix-affinity policy's load probe)."""
    import asyncio

    from ray.serve.request_router import RequestRouter

    probe = RequestRouter._probe_queue_lens
    assert inspect.iscoroutinefunction(probe)
    assert list(inspect.signature(probe).parameters)[:3] == ["self", "replicas", "backoff_index"]
    assert asyncio.run(serve_private.probe_queue_lens(
        SimpleNamespace(_probe_queue_lens=RequestRouter._probe_queue_lens.__get__(
            SimpleNamespace())), [])) == []
