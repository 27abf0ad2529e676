"""The router's handles take the transport of the router's own data plane, not the driver's.
(The real stack's router reports its transport: tests/integration/test_openai_client.py.)"""

from __future__ import annotations

from types import SimpleNamespace

from serve_app.ingress import transport


class _Handle:
    """What transport.py touches of a DeploymentHandle: options() and its _by_reference."""

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
    assert not transport.uses_grpc(built_in_driver)
    monkeypatch.setattr(transport, "RAY_SERVE_USE_GRPC_BY_DEFAULT", True)
    assert transport.uses_grpc(transport.on_data_plane(built_in_driver))


def test_without_the_grpc_data_plane_handles_stay_actor_calls(monkeypatch):
    monkeypatch.setattr(transport, "RAY_SERVE_USE_GRPC_BY_DEFAULT", False)
    assert not transport.uses_grpc(transport.on_data_plane(_Handle(by_reference=False)))
