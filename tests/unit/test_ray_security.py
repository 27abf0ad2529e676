"""serve_app/ray_security.py: what a local Ray of the stack is started with (token auth pinned
on, the dashboard on loopback), and the guard for the Ray internal it relies on. The live check
(every port of a running stack, called as a stranger) is tests/integration/test_ray_listeners.py."""

from __future__ import annotations

import inspect
import logging
import os

import pytest

from serve_app import ray_security
from serve_app.ray_security import AUTH_MODE_ENV, apply_local_ray_settings, local_ray_settings


def test_token_auth_is_pinned_when_unset():
    env, kwargs = local_ray_settings(environ={})
    assert env == {AUTH_MODE_ENV: "token"}
    assert kwargs == {"dashboard_host": "127.0.0.1"}


@pytest.mark.parametrize("mode", ["token", "disabled"])
def test_an_operators_auth_mode_is_kept(mode):
    environ = {AUTH_MODE_ENV: mode}
    env, _ = local_ray_settings(environ=environ)
    assert AUTH_MODE_ENV not in env
    assert environ == {AUTH_MODE_ENV: mode}  # only read


@pytest.fixture
def reloads(monkeypatch):
    """Ray's config reload, recorded instead of run."""
    calls: list[str] = []
    monkeypatch.setattr(ray_security, "reload_ray_config", lambda: calls.append("reload"))
    monkeypatch.delenv(AUTH_MODE_ENV, raising=False)
    return calls


def test_apply_sets_unset_variables_and_refreshes_ray(reloads):
    ray_init: dict = {"num_cpus": 4}
    apply_local_ray_settings(ray_init)
    assert os.environ[AUTH_MODE_ENV] == "token"
    assert ray_init == {"num_cpus": 4, "dashboard_host": "127.0.0.1"}
    # Ray read RAY_AUTH_MODE when it was imported: without the reload a driver that sets it
    # now fails to start Ray ("Authentication token is missing").
    assert reloads == ["reload"]


def test_apply_keeps_what_the_caller_and_the_operator_chose(reloads, monkeypatch, caplog):
    monkeypatch.setenv(AUTH_MODE_ENV, "disabled")
    ray_init = {"dashboard_host": "0.0.0.0"}
    with caplog.at_level(logging.WARNING, logger="serve_app.ray_security"):
        apply_local_ray_settings(ray_init)
    assert os.environ[AUTH_MODE_ENV] == "disabled"
    assert ray_init == {"dashboard_host": "0.0.0.0"}
    assert reloads == []  # no variable set: nothing of Ray's to refresh
    assert "RAY_AUTH_MODE=disabled" in caplog.text


def test_start_stack_pins_token_auth_before_ray_starts():
    """launch.start_stack applies the settings to a Ray of its own, before ray.init."""
    from serve_app import launch

    source = inspect.getsource(launch.start_stack)
    assert source.index("apply_local_ray_settings(ray_init)") < source.index("ray.init(")


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


def test_guard_serves_inter_deployment_grpc_binds_every_interface():
    """Serve's per-replica gRPC server ignores the node's IP (token auth guards it). If Serve
    starts binding it by a host, the docs' port table and ray_security should say so."""
    from pathlib import Path

    import ray.serve._private.replica as replica

    source = Path(replica.__file__).read_text()
    assert 'add_port_to_grpc_server(self._server, "[::]:0")' in source
    assert "create_grpc_server_with_interceptors(" in source  # the token interceptor
