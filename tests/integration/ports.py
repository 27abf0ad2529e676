"""Ports for the test stacks that nothing else on this machine takes between choosing and binding.

A port found free with ``bind(("", 0))`` lies in the kernel's ephemeral range, the range it also
hands every outgoing connection and every other ``bind(0)``. Ray opens hundreds of both while a
stack starts, so such a port could be taken by the time HAProxy binds it (a clean-clone CI run:
"cannot bind socket (Address already in use) for 127.0.0.1:43727"). :func:`free_port` picks
instead, at random, a port that nothing hands out by itself: below the kernel's ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``; Ray's own "free port" choices and a local Ray's
worker ports come from there) and above the worker ports ``ray start`` reserves (10002-19999).
Only another process choosing the same port at the same moment could take it; the suite's stack
also retries with fresh ports when the start-up check (serve_app.launch.check_ports) finds one
taken, before Ray starts.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

# `ray start`'s default worker ports end here (--max-worker-port 19999).
LOWEST = 20000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def quiet_range() -> range:
    """Ports neither the kernel's automatic choices nor Ray's hand out on this machine."""
    try:
        first_ephemeral = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 32768  # Linux's default
    return range(LOWEST, max(LOWEST + 1000, first_ephemeral))


def free_port(host: str = "127.0.0.1", exclude: set[int] | None = None) -> int:
    """A port of :func:`quiet_range` that can be bound on ``host`` now (a listener or a
    TIME_WAIT socket there counts as taken), not in ``exclude``."""
    ports = quiet_range()
    for _ in range(200):
        port = random.choice(ports)
        if exclude and port in exclude:
            continue
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {ports.start}-{ports.stop - 1} after 200 tries")


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct :func:`free_port` ports."""
    chosen: list[int] = []
    for _ in range(count):
        chosen.append(free_port(host, exclude=set(chosen)))
    return chosen
