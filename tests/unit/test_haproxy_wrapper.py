"""The HAProxy wrapper runs Ray Serve's own HAProxy binary with kernel splicing off."""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest

from serve_app.ingress import haproxy

from ..integration.ports import free_ports


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
    stats, metrics, http = free_ports(3)
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


def test_admin_env_carries_the_router_settings(short_tmp, monkeypatch):
    from serve_app.config import RouterSettings

    monkeypatch.setenv(haproxy.HAPROXY_DIR_ENV, str(short_tmp / "h"))
    monkeypatch.setattr(haproxy, "LEGACY_HAPROXY_DIR", short_tmp / "legacy")
    env = haproxy.admin_env(RouterSettings(haproxy_stats_port=18404, haproxy_metrics_port=19101,
                                           fallback_proxy_port=18500,
                                           haproxy_admin_host="0.0.0.0"))
    assert env == {haproxy.ADMIN_HOST_ENV: "0.0.0.0", haproxy.STATS_PORT_ENV: "18404",
                   haproxy.METRICS_PORT_ENV: "19101", haproxy.FALLBACK_PROXY_PORT_ENV: "18500",
                   **haproxy.haproxy_env()}
    # Ray Serve reads these names.
    from ray.serve._private import constants

    source = open(constants.__file__).read()
    for name in (haproxy.STATS_PORT_ENV, haproxy.METRICS_PORT_ENV,
                 haproxy.FALLBACK_PROXY_PORT_ENV):
        assert f'"{name}"' in source


# HAProxy's admin socket and the wrapper live in folders only this user can change.

def _mode(path) -> int:
    return os.stat(path).st_mode & 0o777


@pytest.fixture
def short_tmp():
    """A folder with a short path (pytest's tmp_path is too long for HAProxy's sockets)."""
    import shutil
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.mkdtemp(prefix="sa-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_the_admin_socket_is_mode_600_in_a_folder_of_mode_700(tmp_path):
    """Ray's template makes HAProxy's admin socket (`level admin`: stop HAProxy, change its
    backends, take its listening sockets) `mode 666`; through the wrapper it is 600, and the
    config's folder 0700."""
    config = _rays_config(tmp_path, *free_ports(3))
    assert " mode 666 level admin" in open(config).read()  # Ray's template
    os.chmod(tmp_path, 0o755)
    wrapper = haproxy.write_wrapper(tmp_path / "bin")
    proc = subprocess.Popen([str(wrapper), "-db", "-f", config], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        sock = tmp_path / "admin.sock"
        assert _until(lambda: sock.exists() or proc.poll() is not None), "no admin socket"
        assert proc.poll() is None, proc.stdout.read()
        assert _mode(sock) == 0o600 and _mode(tmp_path) == 0o700
        assert " mode 600 level admin" in open(config).read()
    finally:
        proc.kill()
        proc.wait()


def test_a_stats_socket_without_a_mode_gets_600(tmp_path):
    config = tmp_path / "haproxy.cfg"
    config.write_text("global\n    stats socket /x/admin.sock level admin\n")
    wrapper = haproxy.write_wrapper(tmp_path / "bin", binary="/bin/true")
    assert subprocess.run([str(wrapper), "-f", str(config)]).returncode == 0
    assert config.read_text() == "global\n    stats socket /x/admin.sock level admin mode 600\n"


def test_the_wrapper_refuses_a_config_folder_of_another_user(tmp_path):
    if os.getuid() != 0:
        pytest.skip("needs root to give a folder to another user")
    folder = tmp_path / "theirs"
    folder.mkdir()
    config = folder / "haproxy.cfg"
    config.write_text("global\n    stats socket /x/admin.sock mode 666 level admin\n")
    os.chown(folder, 65534, 65534)
    wrapper = haproxy.write_wrapper(tmp_path / "bin", binary="/bin/true")
    out = subprocess.run([str(wrapper), "-f", str(config)], capture_output=True, text=True)
    assert out.returncode == 2 and "not a folder of this user" in out.stderr
    assert "mode 666" in config.read_text()


def test_write_wrapper_refuses_a_folder_of_another_user(tmp_path, monkeypatch):
    folder = tmp_path / "bin"
    folder.mkdir(mode=0o700)
    real = os.getuid()
    monkeypatch.setattr(haproxy.os, "getuid", lambda: real + 1)  # the folder is not "ours"
    with pytest.raises(haproxy.UnsafeFolderError, match=f"belongs to uid {real}"):
        haproxy.write_wrapper(folder, binary="/opt/haproxy")
    assert not (folder / haproxy.WRAPPER_NAME).exists()


def test_write_wrapper_refuses_a_folder_others_may_write(tmp_path):
    folder = tmp_path / "bin"
    folder.mkdir()
    os.chmod(folder, 0o777)
    with pytest.raises(haproxy.UnsafeFolderError, match="may be written by other users"):
        haproxy.write_wrapper(folder, binary="/opt/haproxy")
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(haproxy.UnsafeFolderError, match="not a link"):
        haproxy.write_wrapper(link, binary="/opt/haproxy")


def test_the_default_wrapper_folder_is_made_again_when_others_may_write_it(tmp_path,
                                                                          monkeypatch):
    """The wrapper went to a predictable folder of the temp dir, accepted as it was: another
    user who made it first (world-writable) could replace the program Ray runs."""
    monkeypatch.setattr(haproxy.tempfile, "tempdir", str(tmp_path))
    folder = tmp_path / f"serve-app-{os.getuid()}"
    folder.mkdir()
    os.chmod(folder, 0o777)
    (folder / "planted").write_text("someone else's")
    path = haproxy.write_wrapper(binary="/opt/haproxy")
    assert path.parent == folder and _mode(folder) == 0o700
    assert sorted(p.name for p in folder.iterdir()) == [haproxy.WRAPPER_NAME]
    os.chmod(folder, 0o755)  # ours, readable by others: only tightened
    assert haproxy.write_wrapper(binary="/opt/haproxy") == path and _mode(folder) == 0o700


def test_rays_haproxy_files_go_to_a_private_folder(short_tmp, monkeypatch):
    """Ray put them in `/tmp/haproxy-serve/<node id>/`, shared by every user of the host."""
    monkeypatch.setattr(haproxy, "LEGACY_HAPROXY_DIR", short_tmp / "legacy")
    folder = short_tmp / "h"
    monkeypatch.setenv(haproxy.HAPROXY_DIR_ENV, str(folder))
    env = haproxy.haproxy_env()
    assert _mode(folder) == 0o700
    assert env == {haproxy.CONFIG_FILE_ENV: f"{folder}/haproxy.cfg",
                   haproxy.SOCKET_PATH_ENV: f"{folder}/admin.sock",
                   haproxy.SERVER_STATE_BASE_ENV: str(folder),
                   haproxy.SERVER_STATE_FILE_ENV: f"{folder}/server-state",
                   haproxy.METRICS_SOCKET_ENV: f"{folder}/metrics.sock"}
    from ray.serve._private import constants

    source = open(constants.__file__).read()  # Ray Serve reads these names
    assert all(f'"{name}"' in source for name in env)
    # The default is the user's own, short enough for HAProxy's socket paths even where
    # TMPDIR is long; a configured folder that is too long is refused up front.
    monkeypatch.setattr(haproxy.tempfile, "tempdir", str(short_tmp / ("x" * 40)))
    assert haproxy.default_haproxy_dir().name == f"haproxy-serve-{os.getuid()}"
    assert len(str(haproxy.default_haproxy_dir())) + 68 <= haproxy.MAX_SOCKET_PATH
    monkeypatch.setenv(haproxy.HAPROXY_DIR_ENV, str(short_tmp / ("x" * 40)))
    with pytest.raises(ValueError, match=haproxy.HAPROXY_DIR_ENV):
        haproxy.haproxy_env()


def test_folders_of_dead_haproxy_instances_are_removed(tmp_path):
    """Every Ray node left its `/tmp/haproxy-serve/<node id>` folder behind."""
    base, proc = tmp_path / "h", tmp_path / "proc"
    dead, live, young, other = ("a" * 56, "b" * 56, "c" * 56, "not-a-node")
    for name in (dead, live, young, other):
        (base / name).mkdir(parents=True)
        (base / name / "haproxy.cfg").write_text("x")
    (proc / "4242").mkdir(parents=True)
    (proc / "4242" / "cmdline").write_bytes(
        f"haproxy\0-dS\0-db\0-f\0{base / live}/haproxy.cfg\0".encode())
    now = time.time()
    for name in (dead, live, other):
        for p in (base / name / "haproxy.cfg", base / name):
            os.utime(p, (now - 3600, now - 3600))
    removed = haproxy.sweep_stale(base, proc_root=proc, now=now)
    assert removed == [base / dead]
    assert sorted(p.name for p in base.iterdir()) == sorted([live, young, other])
    # No /proc: liveness cannot be told, nothing is removed.
    assert haproxy.sweep_stale(base, proc_root=tmp_path / "none", now=now + 7200) == []


def test_shell_exports_give_a_ray_start_node_the_wrapper_and_the_private_folder(short_tmp,
                                                                                monkeypatch):
    monkeypatch.setattr(haproxy.tempfile, "tempdir", str(short_tmp))
    monkeypatch.setattr(haproxy, "LEGACY_HAPROXY_DIR", short_tmp / "legacy")
    monkeypatch.setenv(haproxy.HAPROXY_DIR_ENV, str(short_tmp / "h"))
    script = haproxy.shell_exports() + f"\necho ${haproxy.BINARY_ENV} ${haproxy.SOCKET_PATH_ENV}"
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True)
    wrapper = short_tmp / f"serve-app-{os.getuid()}" / haproxy.WRAPPER_NAME
    assert out.stdout.split() == [str(wrapper), str(short_tmp / "h" / "admin.sock")]
