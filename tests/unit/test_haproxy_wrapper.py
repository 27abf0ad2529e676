"""The HAProxy wrapper runs Ray Serve's own HAProxy binary with kernel splicing off."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest

from serve_app.ingress import haproxy


def test_wrapper_runs_the_bundled_binary_without_splicing(tmp_path):
    path = haproxy.write_wrapper(tmp_path)
    assert os.access(path, os.X_OK)
    text = path.read_text()
    assert haproxy.real_binary() in text and f" {haproxy.NO_SPLICE_FLAG} " in text
    # It really starts HAProxy (the version banner), with the flag accepted.
    out = subprocess.run([str(path), "-v"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.startswith("HAProxy version"), out


def test_wrapper_is_rewritten_only_when_it_changes(tmp_path):
    first = haproxy.write_wrapper(tmp_path, binary="/opt/haproxy")
    stamp = first.stat().st_mtime_ns
    assert haproxy.write_wrapper(tmp_path, binary="/opt/haproxy").stat().st_mtime_ns == stamp
    again = haproxy.write_wrapper(tmp_path, binary="/opt/other haproxy")
    assert "'/opt/other haproxy' -dS" in again.read_text()
    assert list(tmp_path.iterdir()) == [again]  # no partial file left behind


def test_a_wrapper_written_under_a_running_stack_runs_haproxy_regression_self_exec(
        tmp_path, monkeypatch):
    """A process started under a running stack inherits RAY_SERVE_HAPROXY_BINARY_PATH pointing
    at the wrapper; the wrapper it wrote exec'd itself forever, so HAProxy never started (the
    two-node test cluster's Serve failed to start, and this file's `-v` test hung after it)."""
    first = haproxy.write_wrapper(tmp_path)
    monkeypatch.setenv(haproxy.BINARY_ENV, str(first))
    second = haproxy.write_wrapper(tmp_path)  # the same file, as every process writes it
    assert f"exec {first} " not in second.read_text()
    out = subprocess.run([str(second), "-v"], capture_output=True, text=True, timeout=10)
    assert out.returncode == 0 and out.stdout.startswith("HAProxy version"), out
    assert os.environ[haproxy.BINARY_ENV] == str(first)  # the operator's setting is kept


# HAProxy's stats page and Prometheus exporter: loopback unless the config opens them.

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _non_loopback_address() -> str | None:
    """An IPv4 address of this host other than loopback (None if it has none)."""
    import psutil

    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


def _rays_config(tmp_path, stats_port: int, metrics_port: int, http_port: int) -> str:
    """The HAProxy config Ray Serve 2.60 writes (its own template and generator), for ports of
    our choosing; returns its path."""
    from ray.serve._private.haproxy import HAProxyApi, HAProxyConfig
    from ray.serve.config import HTTPOptions

    cfg = HAProxyConfig(socket_path=str(tmp_path / "admin.sock"),
                        server_state_base=str(tmp_path), server_state_file=str(tmp_path / "st"),
                        stats_port=stats_port, metrics_port=metrics_port,
                        http_options=HTTPOptions(host="127.0.0.1", port=http_port))
    cfg.metrics_enabled = False  # no metrics log socket in this test
    api = HAProxyApi(cfg=cfg, config_file_path=str(tmp_path / "haproxy.cfg"))
    api._generate_config_file_internal()
    return api.config_file_path


def _connects(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except ConnectionRefusedError:
        return False


def _until(predicate, timeout_s: float = 20.0) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("admin_host", [None, "0.0.0.0"])
def test_stats_and_metrics_bind_loopback_unless_opened(tmp_path, monkeypatch, admin_host):
    """Ray's own config run through the wrapper: the stats page and the Prometheus exporter
    answer on 127.0.0.1 and refuse the host's other address; with the admin host 0.0.0.0 (the
    config field that opens them) they answer there too. The OpenAI frontend keeps its host."""
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    stats, metrics, http = _free_port(), _free_port(), _free_port()
    config = _rays_config(tmp_path, stats, metrics, http)
    assert f"bind *:{stats}" in open(config).read()  # Ray's template: every interface
    wrapper = haproxy.write_wrapper(tmp_path / "bin")
    if admin_host is None:
        monkeypatch.delenv(haproxy.ADMIN_HOST_ENV, raising=False)
    else:
        monkeypatch.setenv(haproxy.ADMIN_HOST_ENV, admin_host)
    proc = subprocess.Popen([str(wrapper), "-db", "-f", config], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        assert _until(lambda: _connects("127.0.0.1", stats) or proc.poll() is not None), \
            "HAProxy did not start"
        assert proc.poll() is None, proc.stdout.read()
        assert _until(lambda: _connects("127.0.0.1", metrics))
        opened = admin_host is not None
        assert _connects(address, stats) is opened
        assert _connects(address, metrics) is opened
        assert _connects("127.0.0.1", http) and not _connects(address, http)
        text = open(config).read()  # rewritten in place: Ray finds its path in the cmdline
        host = admin_host or "127.0.0.1"
        assert f"bind {host}:{stats}" in text and f"bind {host}:{metrics}" in text
        assert f"-f {config}" in " ".join(open(f"/proc/{proc.pid}/cmdline").read().split("\0"))
    finally:
        proc.kill()
        proc.wait()


def test_the_wrapper_refuses_an_admin_host_that_is_no_address(tmp_path, monkeypatch):
    config = tmp_path / "haproxy.cfg"
    config.write_text("listen stats\n  bind *:8404\n")
    monkeypatch.setenv(haproxy.ADMIN_HOST_ENV, "1.2.3.4/x;rm")
    wrapper = haproxy.write_wrapper(tmp_path / "bin", binary="/bin/true")
    out = subprocess.run([str(wrapper), "-f", str(config)], capture_output=True, text=True)
    assert out.returncode == 2 and haproxy.ADMIN_HOST_ENV in out.stderr
    assert config.read_text() == "listen stats\n  bind *:8404\n"


def test_admin_env_carries_the_router_settings():
    from serve_app.config import RouterSettings

    env = haproxy.admin_env(RouterSettings(haproxy_stats_port=18404, haproxy_metrics_port=19101,
                                           fallback_proxy_port=18500,
                                           haproxy_admin_host="0.0.0.0"))
    assert env == {haproxy.ADMIN_HOST_ENV: "0.0.0.0", haproxy.STATS_PORT_ENV: "18404",
                   haproxy.METRICS_PORT_ENV: "19101", haproxy.FALLBACK_PROXY_PORT_ENV: "18500"}
    # Ray Serve reads these names.
    from ray.serve._private import constants

    source = open(constants.__file__).read()
    for name in (haproxy.STATS_PORT_ENV, haproxy.METRICS_PORT_ENV,
                 haproxy.FALLBACK_PROXY_PORT_ENV):
        assert f'"{name}"' in source
