"""serve_app/ray_security.py: what a local Ray of the stack is started with (token auth pinned,
Ray's ports on loopback beside a loopback router), and guards for the Ray internals it relies on.
The live check (every port of a running stack, called as a stranger) is
tests/integration/test_ray_listeners.py."""

from __future__ import annotations

import inspect
import logging
import os
from pathlib import Path

import pytest

from serve_app import ray_security
from serve_app.ray_security import (
    AUTH_MODE_ENV,
    CLUSTER_ENV,
    apply_local_ray_settings,
    is_loopback_host,
    local_ray_settings,
)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "LOCALHOST", "::1", "[::1]",
                                  "127.0.0.2"])
def test_loopback_hosts(host):
    assert is_loopback_host(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.10", "10.0.0.1", "example.com", ""])
def test_other_hosts(host):
    assert not is_loopback_host(host)


def test_token_auth_is_pinned_when_unset():
    env, _ = local_ray_settings("127.0.0.1", environ={})
    assert env[AUTH_MODE_ENV] == "token"


@pytest.mark.parametrize("mode", ["token", "disabled"])
def test_an_operators_auth_mode_is_kept(mode):
    environ = {AUTH_MODE_ENV: mode}
    env, _ = local_ray_settings("127.0.0.1", environ=environ)
    assert AUTH_MODE_ENV not in env
    assert environ == {AUTH_MODE_ENV: mode}  # only read


def test_a_loopback_router_puts_rays_node_on_loopback():
    env, kwargs = local_ray_settings("127.0.0.1", environ={})
    assert kwargs == {"dashboard_host": "127.0.0.1", "_node_ip_address": "127.0.0.1"}
    assert env == {AUTH_MODE_ENV: "token", CLUSTER_ENV: "0"}


@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.10"])
def test_a_reachable_router_keeps_rays_node_ip_but_not_its_dashboard(host):
    env, kwargs = local_ray_settings(host, environ={})
    assert kwargs == {"dashboard_host": "127.0.0.1"}
    assert env == {AUTH_MODE_ENV: "token"}


@pytest.fixture
def ray_hooks(monkeypatch):
    """The two steps that touch Ray's process state, recorded instead of run."""
    calls: list[str] = []
    monkeypatch.setattr(ray_security, "_reload_ray_config", lambda: calls.append("reload"))
    monkeypatch.setattr(ray_security, "_allow_loopback_node_ip",
                        lambda: calls.append("loopback"))
    monkeypatch.delenv(AUTH_MODE_ENV, raising=False)
    monkeypatch.delenv(CLUSTER_ENV, raising=False)
    return calls


def test_apply_sets_unset_variables_and_refreshes_ray(ray_hooks):
    ray_init: dict = {"num_cpus": 4}
    apply_local_ray_settings("127.0.0.1", ray_init)
    assert os.environ[AUTH_MODE_ENV] == "token"
    assert os.environ[CLUSTER_ENV] == "0"
    assert ray_init == {"num_cpus": 4, "dashboard_host": "127.0.0.1",
                        "_node_ip_address": "127.0.0.1"}
    # Ray read RAY_AUTH_MODE when it was imported: without the reload a driver that sets it
    # now fails to start Ray ("Authentication token is missing").
    assert ray_hooks == ["reload", "loopback"]


def test_apply_keeps_what_the_caller_and_the_operator_chose(ray_hooks, monkeypatch, caplog):
    monkeypatch.setenv(AUTH_MODE_ENV, "disabled")
    ray_init = {"dashboard_host": "0.0.0.0", "_node_ip_address": "192.0.2.10"}
    with caplog.at_level(logging.WARNING, logger="serve_app.ray_security"):
        apply_local_ray_settings("127.0.0.1", ray_init)
    assert os.environ[AUTH_MODE_ENV] == "disabled"
    assert ray_init == {"dashboard_host": "0.0.0.0", "_node_ip_address": "192.0.2.10"}
    assert ray_hooks == []  # nothing of Ray's to refresh: no variable set, no loopback node
    assert "RAY_AUTH_MODE=disabled" in caplog.text


def test_apply_beside_a_reachable_router_leaves_the_node_ip_to_ray(ray_hooks):
    ray_init: dict = {}
    apply_local_ray_settings("0.0.0.0", ray_init)
    assert ray_init == {"dashboard_host": "127.0.0.1"}
    assert CLUSTER_ENV not in os.environ
    assert ray_hooks == ["reload"]


# Guards: the Ray 2.60 internals ray_security relies on. When one fails after a Ray upgrade,
# re-read the module docstring's facts against the new Ray before changing the test.

def test_guard_ray_reads_the_auth_mode_from_this_variable():
    from ray._private.authentication import authentication_token_setup

    assert authentication_token_setup.AUTH_MODE_ENV_VAR == AUTH_MODE_ENV
    # Ray's own "turn token auth on" step is: set the variable, then Config.initialize("").
    source = inspect.getsource(authentication_token_setup._enable_token_auth)
    assert "Config.initialize" in source
    from ray._raylet import Config

    assert callable(Config.initialize)


def test_guard_a_loopback_node_ip_needs_enable_ray_cluster_off(monkeypatch):
    import ray
    from ray._private import ray_constants, services

    assert ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR == CLUSTER_ENV
    assert isinstance(ray_constants.ENABLE_RAY_CLUSTER, bool)
    assert ray._private.worker._global_node is None  # no Ray in the unit tests
    # ray.init passes _node_ip_address through resolve_ip_for_localhost, which keeps a loopback
    # address only when the constant is off (read at call time, so setting it works).
    assert "resolve_ip_for_localhost(_node_ip_address)" in inspect.getsource(ray.init)
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    assert services.resolve_ip_for_localhost("127.0.0.1") == "127.0.0.1"
    monkeypatch.undo()
    assert "ray_constants.ENABLE_RAY_CLUSTER" in inspect.getsource(services.get_node_ip_address)


def test_allow_loopback_node_ip_sets_the_constant(monkeypatch):
    from ray._private import ray_constants

    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    ray_security._allow_loopback_node_ip()
    assert ray_constants.ENABLE_RAY_CLUSTER is False


def test_guard_serves_inter_deployment_grpc_binds_every_interface():
    """Serve's per-replica gRPC server ignores the node's IP (token auth guards it). If Serve
    starts binding it by a host, the docs' port table and ray_security should say so."""
    import ray.serve._private.replica as replica

    source = Path(replica.__file__).read_text()
    assert 'add_port_to_grpc_server(self._server, "[::]:0")' in source
    assert "create_grpc_server_with_interceptors(" in source  # the token interceptor
