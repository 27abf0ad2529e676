"""HAProxy's stats page (no authentication) and Prometheus exporter of the running stack answer
on loopback only: from the host's own non-loopback address they are refused, while the OpenAI
endpoint is where `router.host` puts it. The ports are the stack's own (the suite's stack runs
on ports of its own beside any other stack on this machine). HAProxy's sockets are closed to
other users of the host."""

from __future__ import annotations

import socket

import httpx
import pytest

pytestmark = pytest.mark.integration


def _non_loopback_address() -> str | None:
    import psutil  # installed with vLLM

    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


def _refused(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=5):
            return False
    except ConnectionRefusedError:
        return True


def test_stats_and_metrics_answer_on_loopback_and_refuse_the_hosts_address(stack):
    router = stack["config"].router
    assert router.haproxy_admin_host == "127.0.0.1"  # the default
    stats, metrics = router.haproxy_stats_port, router.haproxy_metrics_port
    assert (stats, metrics) != (8404, 9101)  # the suite's own ports, not the defaults
    # They are up (so a refusal below is the bind, not a dead HAProxy).
    assert httpx.get(f"http://127.0.0.1:{stats}/stats", timeout=10).status_code == 200
    assert "haproxy_" in httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=10).text
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    assert _refused(address, stats), f"HAProxy's stats page answers on {address}:{stats}"
    assert _refused(address, metrics), f"HAProxy's metrics answer on {address}:{metrics}"


def _haproxy_listening_on(port: int):
    """The HAProxy process that listens on ``port`` (the stack's own stats port)."""
    import psutil

    for c in psutil.net_connections(kind="tcp"):
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
            proc = psutil.Process(c.pid)
            if "haproxy" in proc.name():
                return proc
    return None


def test_no_haproxy_socket_is_writable_by_other_users(stack):
    """Ray's template made HAProxy's admin socket (`level admin`) `mode 666` in
    `/tmp/haproxy-serve/<node id>/`, a folder every user of the host shares. In the running
    stack, every socket in HAProxy's folder (the admin socket, the metrics log socket) and
    every UNIX socket HAProxy listens on is closed to other users: mode without group or other
    write, in a folder of this user with mode 0700 (serve_app/ingress/haproxy.py)."""
    import os
    import re
    import stat
    from pathlib import Path

    from serve_app.ingress import haproxy

    proc = _haproxy_listening_on(stack["config"].router.haproxy_stats_port)
    assert proc is not None, "no HAProxy listens on the stack's stats port"
    args = proc.cmdline()
    config = Path(args[args.index("-f") + 1])
    folder = config.parent
    assert haproxy.LEGACY_HAPROXY_DIR not in folder.parents, folder
    st = os.stat(folder)
    assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700, (
        folder, oct(st.st_mode))
    parent = os.stat(folder.parent)  # this user's haproxy-serve-<uid>: private as well
    assert parent.st_uid == os.getuid() and stat.S_IMODE(parent.st_mode) == 0o700
    sockets = set()
    for p in folder.iterdir():
        try:
            if stat.S_ISSOCK(os.lstat(p).st_mode):
                sockets.add(p)
        except FileNotFoundError:  # HAProxy binds `<socket>.<pid>.tmp`, then renames it
            pass
    # A socket HAProxy listens on keeps its bind name, `<socket>.<pid>.tmp`.
    sockets |= {Path(re.sub(r"\.[0-9]+\.tmp$", "", c.laddr))
                for c in proc.net_connections(kind="unix")
                if isinstance(c.laddr, str) and c.laddr.startswith("/")}
    admin = folder / "admin.sock"
    assert admin in sockets, sockets
    assert stat.S_IMODE(os.stat(admin).st_mode) == 0o600
    for path in sockets:
        assert path.parent == folder, f"{path} lies outside HAProxy's private folder"
        # Writing to a UNIX socket takes write on it and search on its folder (0700, above):
        # Ray binds the metrics log socket 666, which only this user can reach.
        mode = stat.S_IMODE(os.stat(path).st_mode)
        folder_mode = stat.S_IMODE(os.stat(path.parent).st_mode)
        assert not (mode & 0o022 and folder_mode & 0o011), (
            f"{path} is writable by other users (mode {mode:o} in a folder of mode "
            f"{folder_mode:o})")
    assert " mode 600 " in config.read_text()
