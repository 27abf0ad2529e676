"""HAProxy's stats page (no authentication) and Prometheus exporter of the running stack answer
on loopback only: from the host's own non-loopback address they are refused, while the OpenAI
endpoint is where `router.host` puts it. The ports are the stack's own (the suite's stack runs
on ports of its own beside any other stack on this machine)."""

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
