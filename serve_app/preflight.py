"""What runs on this machine before a local Ray starts (:func:`serve_app.launch.start_stack`),
and after the stack stops.

Leftovers: vLLM engine processes and Ray Serve's HAProxy outlive a parent that was SIGKILLed
(seen on a GPU host: the next engine found 11 GiB free of 140, and HAProxy held ports 8000, 8404
and 9101). Ray's own processes share the fate of the driver that started them; those two do
not. :func:`reap_leftovers` removes this user's orphaned ones.

Ports: every port the stack will listen on is checked (:func:`check_ports`): a port another
program or another stack holds fails at once with :class:`PortInUseError`, which names the port
and the setting that moves it, instead of a HAProxy that crashes inside Serve a minute later.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from serve_app.config import AppConfig, ConfigError

logger = logging.getLogger(__name__)

# vLLM names its processes VLLM::EngineCore, VLLM::Worker_TP0, ... (setproctitle).
VLLM_TITLE_PREFIX = "VLLM::"
# Ray Serve starts `haproxy -db -f /tmp/haproxy-serve/haproxy.cfg` (per node).
HAPROXY_CONFIG_MARK = "haproxy-serve"


@dataclass(frozen=True)
class Leftover:
    """An orphaned process of an earlier run: its pid and what it is."""

    pid: int
    what: str


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def find_leftovers(proc_root: Path = Path("/proc"), uid: int | None = None) -> list[Leftover]:
    """This user's vLLM engine processes and Serve HAProxy processes whose parent is gone.

    A process whose parent died is re-parented to init (ppid 1); one whose parent is alive
    belongs to a running stack (possibly another one on this machine) and is left alone.
    ``proc_root`` is a /proc-like tree (a fake one in the unit tests)."""
    uid = os.getuid() if uid is None else uid
    found: list[Leftover] = []
    for entry in proc_root.iterdir() if proc_root.is_dir() else ():
        if not entry.name.isdigit():
            continue
        stat, cmdline = _read(entry / "stat"), _read(entry / "cmdline")
        status = _read(entry / "status")
        if not stat or not cmdline or not status:
            continue
        # ppid is the 2nd field after the parenthesised command name (which may hold spaces).
        fields = stat[stat.rfind(b")") + 2:].split()
        ppid = int(fields[1]) if len(fields) > 1 else -1
        owner = next((int(line.split()[1]) for line in status.splitlines()
                      if line.startswith(b"Uid:")), -1)
        if ppid != 1 or owner != uid:
            continue
        args = [a.decode(errors="replace") for a in cmdline.split(b"\0") if a]
        if not args:
            continue
        if args[0].startswith(VLLM_TITLE_PREFIX):
            found.append(Leftover(int(entry.name), args[0].split()[0]))
        elif Path(args[0]).name == "haproxy" and any(HAPROXY_CONFIG_MARK in a for a in args):
            found.append(Leftover(int(entry.name), "haproxy"))
    return found


def reap_leftovers(timeout_s: float = 10.0) -> list[Leftover]:
    """Kill :func:`find_leftovers`' processes and wait until they are gone; returns them."""
    leftovers = find_leftovers()
    for p in leftovers:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    while leftovers and time.monotonic() < deadline:
        if not any(Path(f"/proc/{p.pid}").exists() for p in leftovers):
            break
        time.sleep(0.1)
    if leftovers:
        logger.warning("removed leftovers of an earlier run: %s",
                       ", ".join(f"{p.what} (pid {p.pid})" for p in leftovers))
    return leftovers


class PortInUseError(ConfigError):
    """A port the local stack must listen on is taken. ``port`` and ``setting`` (the config
    field that moves it) say which; raised before Ray starts."""

    def __init__(self, message: str, port: int, setting: str) -> None:
        super().__init__(message)
        self.port = port
        self.setting = setting


def stack_ports(config: AppConfig) -> list[tuple[str, int, str, str]]:
    """(host, port, setting, what) of every port a local stack for ``config`` listens on at a
    fixed number: the OpenAI endpoint, and with the HAProxy data plane HAProxy's stats page and
    metrics exporter and Serve's fallback proxy. (Ray's own ports are picked free by Ray.)"""
    r = config.router
    ports = [(r.host, r.port, "router.port", "the OpenAI endpoint")]
    if r.high_throughput:
        ports += [
            (r.haproxy_admin_host, r.haproxy_stats_port, "router.haproxy_stats_port",
             "HAProxy's stats page"),
            (r.haproxy_admin_host, r.haproxy_metrics_port, "router.haproxy_metrics_port",
             "HAProxy's Prometheus exporter"),
            (r.host, r.fallback_proxy_port, "router.fallback_proxy_port",
             "Serve's fallback proxy"),
        ]
    return ports


def check_ports(config: AppConfig) -> None:
    """Raise :class:`PortInUseError` for the first of :func:`stack_ports` that cannot be bound
    now (another stack or program listens there), ConfigError for a host that is not this
    machine's. Binds as the servers will (SO_REUSEADDR: a port left in TIME_WAIT is free)."""
    for host, port, setting, what in stack_ports(config):
        bind_host = "" if host in ("*", "0.0.0.0") else host
        try:
            family, kind, proto, _, address = socket.getaddrinfo(
                bind_host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        except socket.gaierror as err:
            raise ConfigError(f"{setting.rsplit('.', 1)[0]} host {host!r} does not resolve "
                              f"({err}); use an address of this machine") from None
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as err:
                if err.errno == errno.EADDRINUSE:
                    raise PortInUseError(
                        f"port {port} on {host} ({what}) is already in use: another stack or "
                        f"program listens there (`ss -ltnp 'sport = :{port}'` shows which). Set "
                        f"{setting} to a free port (two stacks on one host need different "
                        "ports), or stop what holds it.", port, setting) from None
                if err.errno == errno.EADDRNOTAVAIL:
                    raise ConfigError(f"{host} is not an address of this machine ({what}, "
                                      f"{setting}); use 127.0.0.1, 0.0.0.0 or one of its "
                                      "interfaces' addresses") from None
                raise
