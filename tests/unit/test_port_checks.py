"""A port the local stack needs but another program holds fails at once, before Ray starts, and
says which port and which setting moves it (serve_app/launch.py)."""

from __future__ import annotations

import os
import socket

import pytest

from serve_app.config import ConfigError, parse_config
from serve_app.launch import PortInUseError, check_ports, stack_ports

from ..integration.ports import free_ports


def _config(**router):
    return parse_config({"models": [{"name": "m", "path": "/m"}], "router": router})


@pytest.fixture
def held():
    """A port on 127.0.0.1 that something else listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


SETTINGS = ("port", "haproxy_stats_port", "haproxy_metrics_port", "fallback_proxy_port")


def _ports(**taken) -> dict:
    """Router settings with every port free, except ``taken`` (setting -> port). Distinct
    ports (tests/integration/ports.py): four ``bind(0)`` ports, each released before the next
    was drawn, once came back equal and the config refused the pair."""
    ports = dict(zip(SETTINGS, free_ports(len(SETTINGS))))
    return {**ports, **taken}


@pytest.mark.parametrize("setting", SETTINGS)
def test_a_port_in_use_names_the_port_and_its_setting(held, setting):
    with pytest.raises(PortInUseError) as info:
        check_ports(_config(**_ports(**{setting: held})))
    message = str(info.value)
    assert f"port {held} " in message and f"router.{setting}" in message, message
    assert info.value.port == held and info.value.setting == f"router.{setting}"
    assert isinstance(info.value, ConfigError)  # the CLI prints it as a config error


def test_free_ports_pass():
    check_ports(_config(**_ports()))


def test_without_haproxy_only_the_openai_port_is_needed(held):
    cfg = _config(high_throughput=False, **_ports(haproxy_stats_port=held))
    assert [p[2] for p in stack_ports(cfg)] == ["router.port"]
    check_ports(cfg)


def test_a_host_that_is_not_this_machines_is_a_config_error():
    with pytest.raises(ConfigError, match="not an address of this machine"):
        check_ports(_config(haproxy_admin_host="192.0.2.1", **_ports()))


def test_start_stack_refuses_before_ray_starts(held, monkeypatch):
    """The stack's start stops at the check: Ray is never started (no minute-long wait for a
    HAProxy that crashes inside Serve)."""
    import ray

    from serve_app import launch

    monkeypatch.setattr(os, "environ", dict(os.environ))  # start_stack exports its settings
    monkeypatch.setattr(launch, "reap_leftovers", lambda: [])
    started = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: started.append(a))
    with pytest.raises(PortInUseError, match="router.haproxy_metrics_port"):
        launch.start_stack(_config(**_ports(haproxy_metrics_port=held)))
    assert started == []
    # The settings Ray and the wrapper read are the config's.
    assert os.environ["SERVE_APP_HAPROXY_ADMIN_HOST"] == "127.0.0.1"
    assert os.environ["RAY_SERVE_HAPROXY_METRICS_PORT"] == str(held)


def test_ports_must_differ_and_the_admin_host_must_be_an_address():
    with pytest.raises(ConfigError, match="haproxy_stats_port and router.port are both 8000"):
        _config(haproxy_stats_port=8000)
    with pytest.raises(ConfigError, match="haproxy_admin_host"):
        _config(haproxy_admin_host="0.0.0.0; rm -rf /")
    assert _config().router.haproxy_admin_host == "127.0.0.1"


def test_a_local_start_starts_a_ray_of_its_own(monkeypatch):
    """Without an address the stack starts its own Ray ("local"), never joining a `ray start`
    cluster (or a multi-node test cluster) that happens to run on this machine, which
    ray.init(None) would do."""
    import ray

    from serve_app import launch

    monkeypatch.setattr(os, "environ", dict(os.environ))
    monkeypatch.setattr(launch, "reap_leftovers", lambda: [])
    seen = {}

    class Stop(Exception):
        pass

    def init(address=None, **kwargs):
        seen["address"] = address
        raise Stop

    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(Stop):
        launch.start_stack(_config(**_ports()))
    assert seen["address"] == "local"


def test_stopping_after_a_refused_start_touches_no_ray(monkeypatch):
    """`serve-app run` stops the stack whatever happened; after a start refused before Ray
    (a port in use) there is nothing to stop, and serve.shutdown() would start a Ray to look
    for a Serve, or join another stack's on this machine and stop it."""
    import ray
    from ray import serve

    from serve_app import launch

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(serve, "shutdown", lambda: calls.append("serve.shutdown"))
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("ray.shutdown"))
    monkeypatch.setattr(launch, "reap_leftovers", lambda: calls.append("reap") or [])
    launch.stop_stack()
    assert calls == ["ray.shutdown", "reap"]
