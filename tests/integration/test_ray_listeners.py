"""Every TCP port the running stack's Ray and Serve processes listen on beyond loopback refuses a
caller without the cluster's token (issue 41 item 5).

The processes are the suite's Ray session: this test process (the driver, which started Ray) and
everything under it: gcs_server, raylet, the dashboard, the monitor, the dashboard and runtime-env
agents, every worker (Serve's controller, HAProxy manager, router and engine replicas) and what
those start (HAProxy, vLLM's engine processes). A listener on a loopback address is out of reach
of other hosts and is only listed. Each other one is called from the host's own non-loopback
address as a stranger would (no token):

- an HTTP port must answer 401 or 403 (or refuse the connection): the dashboard agent's and the
  runtime-env agent's aiohttp servers check Ray's token in a middleware. The one exception is a
  Prometheus exporter (the metrics agent's, the dashboard's, the autoscaler monitor's): it serves
  metrics text to a GET, answers nothing else and runs no code, and a Prometheus on another host
  may need to scrape it; it is listed, and any other HTTP answer fails the test;
- a gRPC port must fail a real method of its service with UNAUTHENTICATED: GCS, raylet and core
  workers (C++), the dashboard agent and Serve's inter-deployment server (Python, Ray's
  interceptor). A port that answers a method, or serves none of the known ones, fails the test.

Raw bytes go over the wire (an empty message), so no Ray client code (which would add the token)
is involved. HAProxy's stats and metrics ports are checked in test_haproxy_admin.py.

The probe (:func:`probe_session`) takes the root process of any Ray session, so it can be pointed
at a Ray started without token auth to see it fail (the report of issue 41 item 5 says how).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass

import pytest

# The long tier (`make test-long`, which CI runs after `make test`): about 30 s of probes.
pytestmark = [pytest.mark.integration, pytest.mark.long]

# Read-only or harmless methods of every gRPC service a Ray 2.60 process serves, called with an
# empty message. A server answers UNIMPLEMENTED for a method it does not serve before any
# authentication (grpc routes first), so each port is tried until one is served.
GRPC_METHODS = (
    "/ray.rpc.NodeInfoGcsService/GetClusterId",  # gcs_server
    "/ray.rpc.NodeManagerService/GetNodeStats",  # raylet
    "/ray.rpc.CoreWorkerService/NumPendingTasks",  # every worker and the driver
    "/ray.rpc.ReporterService/HealthCheck",  # dashboard agent
    "/ray.rpc.LogService/ListLogs",  # dashboard agent
    "/ray.serve.ASGIService/HandleRequest",  # Serve replicas, inter-deployment gRPC
    "/ray.rpc.ObjectManagerService/Pull",  # raylet's object manager (its only unary methods)
)
# Paths of the HTTP ports: the root, and the dashboard agent's job API (it runs code).
HTTP_PATHS = ("/", "/api/job_agent/jobs/")
REFUSED_HTTP = (401, 403)


@dataclass(frozen=True)
class Listener:
    pid: int
    process: str
    address: str
    port: int

    def __str__(self) -> str:
        return f"{self.process} (pid {self.pid}) on {self.address}:{self.port}"


def _is_loopback(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return False
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def _process_name(proc) -> str:
    """What the process is: Ray's title (``ray::ServeReplica:llm:Router``, ``VLLM::Worker``),
    the script of a Python process (``dashboard.py``, ``monitor.py``) or the program."""
    cmdline = proc.cmdline()
    if not cmdline or not cmdline[0]:
        return proc.name()
    first = cmdline[0].split()[0]
    if first.startswith(("ray::", "VLLM::")):
        return first
    script = next((a for a in cmdline[1:] if a.endswith(".py")), None)
    return os.path.basename(script or first)


def session_listeners(root_pid: int) -> list[Listener]:
    """TCP listeners of ``root_pid`` and every process under it."""
    import psutil  # installed with vLLM

    root = psutil.Process(root_pid)
    found: list[Listener] = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            connections = proc.net_connections(kind="tcp")
            name = _process_name(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        for conn in connections:
            if conn.status == psutil.CONN_LISTEN:
                found.append(Listener(proc.pid, name, conn.laddr.ip, conn.laddr.port))
    return sorted(set(found), key=lambda item: (item.process, item.port))


def host_address() -> str | None:
    """The host's primary non-loopback IPv4 address (the one its default route leaves by)."""
    import psutil

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET: nothing is sent, only a route is chosen
            address = s.getsockname()[0]
            if not _is_loopback(address):
                return address
        except OSError:
            pass
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family == socket.AF_INET and not _is_loopback(a.address):
                return a.address
    return None


def _target(listener: Listener, host: str) -> str:
    """Where a stranger reaches ``listener``: its own address, or the host's for a wildcard."""
    if listener.address in ("0.0.0.0", "::", ""):
        return host
    return listener.address


def _http(address: str, port: int, method: str = "GET"
          ) -> list[tuple[str, int, str]] | None:
    """(path, status, content type) of each of :data:`HTTP_PATHS`; None when the port does not
    speak HTTP/1."""
    import http.client

    answers = []
    for path in HTTP_PATHS:
        # Long enough for an exporter's whole metrics page on a loaded machine (at 5 s one
        # timed out in a full suite run and read as "not HTTP"); a gRPC server closes an HTTP/1
        # connection at once, so the wait costs nothing there.
        conn = http.client.HTTPConnection(address, port, timeout=30)
        try:
            conn.request(method, path, body=b"{}" if method == "POST" else None)
            response = conn.getresponse()
            answers.append((path, response.status, response.getheader("Content-Type") or ""))
        except (http.client.HTTPException, ConnectionResetError, socket.timeout):
            return None  # gRPC servers close an HTTP/1 connection without an answer
        finally:
            conn.close()
    return answers


# What a Prometheus exporter answers a GET with (prometheus_client's text formats).
METRICS_TYPES = ("text/plain; version=0.0.4", "application/openmetrics-text")


def _is_metrics_exporter(address: str, port: int,
                         answers: list[tuple[str, int, str]]) -> bool:
    """Whether the port is a Prometheus exporter and nothing more: every GET path answers
    metrics text, and a POST is not served."""
    if not all(status == 200 and ctype.startswith(METRICS_TYPES)
               for _, status, ctype in answers):
        return False
    posted = _http(address, port, "POST")
    return posted is not None and all(status >= 400 for _, status, _ in posted)


def _grpc(address: str, port: int) -> tuple[str, str] | None:
    """(method, status name) of the first of :data:`GRPC_METHODS` the port serves; None when it
    serves none (every one UNIMPLEMENTED) or does not speak gRPC."""
    import grpc

    target = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
    with grpc.insecure_channel(target) as channel:
        for method in GRPC_METHODS:
            call = channel.unary_unary(method, request_serializer=None,
                                       response_deserializer=None)
            try:
                call(b"", timeout=10)
                return method, "OK"
            except grpc.RpcError as err:
                code = err.code()
                if code == grpc.StatusCode.UNIMPLEMENTED:
                    continue
                if code == grpc.StatusCode.UNAVAILABLE:
                    return None  # not a gRPC server (or gone)
                return method, code.name
    return None


@dataclass(frozen=True)
class Verdict:
    listener: Listener
    target: str
    how: str  # what a stranger got
    refused: bool
    exporter: bool = False  # a read-only Prometheus exporter (see the module docstring)

    def __str__(self) -> str:
        return f"{self.listener} -> {self.target}: {self.how}"


def exporter_ports() -> set[int]:
    """The ports Ray itself names as Prometheus exporters on this machine: each node's metrics
    agent (``MetricsExportPort``), the dashboard's and the autoscaler monitor's."""
    import ray
    from ray.autoscaler._private.constants import AUTOSCALER_METRIC_PORT
    from ray.dashboard.consts import DASHBOARD_METRIC_PORT

    ports = {DASHBOARD_METRIC_PORT, AUTOSCALER_METRIC_PORT}
    ports.update(int(n["MetricsExportPort"]) for n in ray.nodes()
                 if n.get("Alive") and n.get("MetricsExportPort"))
    return ports


def probe(listener: Listener, host: str, exporters: frozenset[int] = frozenset()) -> Verdict:
    """Call ``listener`` as a stranger (no token) at :func:`_target`. A port in ``exporters``
    (:func:`exporter_ports`) may answer metrics text and nothing else; one that does not answer
    in time (its page is rendered whole first, and after a long suite a loaded agent took over
    30 s) is listed as such, not failed: only an answer other than metrics fails it."""
    target = _target(listener, host)
    try:
        socket.create_connection((target, listener.port), timeout=5).close()
    except ConnectionRefusedError:
        return Verdict(listener, target, "connection refused", True)
    except OSError as err:
        return Verdict(listener, target, f"unreachable ({err})", True)
    answers = _http(target, listener.port)
    if answers is None and listener.port in exporters:
        return Verdict(listener, target, "Ray's Prometheus exporter, no answer in time", False,
                       exporter=True)
    if answers is not None:
        how = "HTTP " + ", ".join(f"{path} {status}" for path, status, _ in answers)
        if _is_metrics_exporter(target, listener.port, answers):
            return Verdict(listener, target, how + " (read-only Prometheus exporter)", False,
                           exporter=True)
        return Verdict(listener, target, how,
                       all(status in REFUSED_HTTP for _, status, _ in answers))
    served = _grpc(target, listener.port)
    if served is None:
        return Verdict(listener, target, "neither HTTP nor a known Ray gRPC service: "
                       "cannot show that it refuses a stranger", False)
    method, status = served
    return Verdict(listener, target, f"gRPC {method} {status}", status == "UNAUTHENTICATED")


def probe_session(root_pid: int, host: str) -> tuple[list[Listener], list[Verdict]]:
    """Every listener of the session under ``root_pid``, and a :class:`Verdict` for each one
    that is not on loopback."""
    listeners = session_listeners(root_pid)
    exporters = frozenset(exporter_ports())
    verdicts = [probe(item, host, exporters) for item in listeners
                if not _is_loopback(item.address)]
    return listeners, verdicts


def assert_session_refuses_strangers(root_pid: int) -> list[Verdict]:
    """Probe the Ray session under ``root_pid`` (:func:`probe_session`) from the host's own
    address; AssertionError naming each process and port that answered without the token."""
    host = host_address()
    if host is None:
        pytest.skip("this host has no non-loopback IPv4 address to call from")
    listeners, verdicts = probe_session(root_pid, host)
    names = {item.process for item in listeners}
    # The session was found: the core processes of a local Ray.
    assert {"gcs_server", "raylet"} <= names, names
    print("\nRay session listeners:\n" + "\n".join(f"  {item}" for item in listeners))
    print("probed as a stranger:\n" + "\n".join(f"  {v}" for v in verdicts))
    open_ports = [str(v) for v in verdicts if not v.refused and not v.exporter]
    assert not open_ports, "answered a caller without the token:\n" + "\n".join(open_ports)
    return verdicts


def test_every_ray_port_beyond_loopback_refuses_a_caller_without_the_token(stack):
    import ray

    assert ray.is_initialized()
    # This process is the driver that started the suite's Ray: the session is under it.
    assert_session_refuses_strangers(os.getpid())
    names = {item.process for item in session_listeners(os.getpid())}
    assert any(name.startswith("ray::ServeReplica") for name in names), names
