"""The one way to start and stop the stack: `serve-app run`, the integration tests, the GPU tests
and the bench scripts (through `serve-app run`) all come through here.

Starting a local Ray first removes what a killed earlier run left behind on this machine: vLLM
engine processes and Ray Serve's HAProxy outlive a parent that was SIGKILLed (seen on a GPU host:
the next engine found 11 GiB free of 140, and HAProxy held ports 8000, 8404 and 9101). Ray's own
processes share the fate of the driver that started them; those two do not. Stopping the stack
removes the same kind of leftovers of its own.

Then, still before Ray starts, every port the stack will listen on is checked
(:func:`check_ports`): a port another program or another stack holds fails at once with
:class:`PortInUseError`, which names the port and the setting that moves it, instead of a
HAProxy that crashes inside Serve a minute later.
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
from typing import Any

from serve_app.config import APP_NAME, AppConfig, ConfigError
from serve_app.ingress import haproxy

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


def start_stack(config: AppConfig, address: str | None = None,
                engine_class: str | None = None, **ray_init: Any) -> str:
    """Start Ray (or join ``address``), Serve and the app for ``config``; return its base URL.

    Returns once Serve accepted the app (engines may still be loading: poll /v1/models).
    ``ray_init`` adds ``ray.init`` arguments (tests: ``num_cpus``). Starting a local Ray
    raises :class:`PortInUseError` before Ray starts when a port of the stack is taken."""
    import ray
    from ray import serve

    from serve_app.app import build_app, ray_env

    # Serve reads these when it is imported by Ray's processes, so they go in before Ray starts.
    env = ray_env(config)
    if config.router.high_throughput and address is None:
        # HAProxy without kernel splicing, or client disconnects of POSTs never reach the
        # router (serve_app/ingress/haproxy.py). A binary the operator chose is kept.
        env[haproxy.BINARY_ENV] = str(haproxy.write_wrapper())
    for key, value in env.items():
        os.environ.setdefault(key, value)
    if address is None:
        # Where HAProxy's stats, metrics and Serve's fallback proxy listen: the config decides
        # (an inherited value, e.g. of a stack this process was started under, does not).
        os.environ.update(haproxy.admin_env(config.router))
    wanted = env.get(haproxy.BINARY_ENV)
    if wanted and os.environ[haproxy.BINARY_ENV] != wanted:
        logger.warning("%s=%s is used as set; unless it runs HAProxy with %s, clients that "
                       "leave a non-streaming or queued request are not noticed, and HAProxy's "
                       "stats and metrics pages bind every interface",
                       haproxy.BINARY_ENV, os.environ[haproxy.BINARY_ENV],
                       haproxy.NO_SPLICE_FLAG)
    if address is None:
        reap_leftovers()
        check_ports(config)
    # The dashboard executes code for whoever reaches it: keep it on localhost.
    ray_init.setdefault("dashboard_host", "127.0.0.1")
    # "local": a new Ray of this stack's own, never a `ray start` cluster or a test cluster
    # that happens to run on this machine (ray.init(None) joins one it finds).
    ray.init(address=address or "local", **ray_init)
    serve.start(**serve_start_options(config))
    _record(config, "start")
    app = build_app(config) if engine_class is None else build_app(config, engine_class)
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    return base_url(config)


def wait_until_serving(base: str, timeout_s: float = 300.0, interval_s: float = 1.0,
                       headers: dict[str, str] | None = None) -> None:
    """Return once ``base`` answers ``GET /v1/models`` with 200 (its engines are loaded);
    TimeoutError after ``timeout_s``."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            request = urllib.request.Request(base + "/v1/models", headers=headers or {})
            with urllib.request.urlopen(request, timeout=3) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{base} did not serve /v1/models within {timeout_s:g} s")
        time.sleep(interval_s)


def serve_start_options(config: AppConfig) -> dict[str, Any]:
    """``serve.start`` arguments for ``config``: where the HTTP ingress listens and on which
    nodes it runs (fixed for as long as Serve runs on the cluster)."""
    return {"proxy_location": config.router.proxy_location,
            "http_options": {"host": config.router.host, "port": config.router.port}}


def router_replica_ports(app_name: str = APP_NAME, route_prefix: str = "") -> list[int]:
    """The HTTP ports the router replicas of ``app_name`` on this machine listen on themselves
    (the ones HAProxy forwards to), one per replica, sorted. Clients that need a router's own
    socket behaviour, or one router rather than another, use them: a stream below a few MB
    fits in HAProxy's and the kernel's buffers, so a client that stops reading through HAProxy
    never makes the router's writes wait (bench/RESULTS.md 9c). ``route_prefix``: the app's,
    when it is not served at the root. Empty when no such replica answers here."""
    import urllib.request
    from http.client import HTTPException

    import psutil  # installed with vLLM

    title = f"ServeReplica:{app_name}:Router"
    ports: list[int] = []
    for proc in psutil.process_iter(["cmdline"]):
        if not any(title in arg for arg in proc.info["cmdline"] or []):
            continue
        for conn in proc.net_connections(kind="tcp"):
            if conn.status != psutil.CONN_LISTEN:
                continue
            try:
                with urllib.request.urlopen(
                        f"http://127.0.0.1:{conn.laddr.port}{route_prefix}/health",
                        timeout=2) as answer:
                    if answer.status == 200:
                        ports.append(int(conn.laddr.port))
                        break  # one HTTP port per replica
            except (OSError, HTTPException):  # refused, timeout, not HTTP: another port
                continue
    return sorted(ports)


def router_replica_port(app_name: str = APP_NAME, route_prefix: str = "") -> int:
    """The first of :func:`router_replica_ports`. Raises LookupError when no router replica of
    ``app_name`` answers on this machine."""
    ports = router_replica_ports(app_name, route_prefix)
    if not ports:
        raise LookupError(f"no HTTP port of a {app_name} router replica found on this machine")
    return ports[0]


def base_url(config: AppConfig) -> str:
    """Where the app's OpenAI endpoint answers, seen from this machine."""
    host = "127.0.0.1" if config.router.host in ("0.0.0.0", "::") else config.router.host
    return f"http://{host}:{config.router.port}"


def _record(config: AppConfig, action: str) -> str:
    """Publish ``config`` as the deployed one and its tenants as the live ones, and add an
    audit entry (``action``: start, live or redeploy) naming the tenants it changed."""
    from serve_app.ingress.live_config import publish_config, publish_tenants, read_tenants
    from serve_app.observability.audit import append_audit, audit_entry

    before = read_tenants(APP_NAME)
    dumped = config.model_dump(mode="json")
    publish_config(APP_NAME, dumped)
    version = publish_tenants(APP_NAME, config.tenants)
    try:
        append_audit(APP_NAME, audit_entry(action, dumped, version,
                                           before[1] if before else None, config.tenants))
    except Exception:  # the change is made; a lost audit entry must not undo or hide it
        logger.exception("could not write the audit entry of this deploy")
    return version


def _structure(config: dict[str, Any]) -> dict[str, Any]:
    """What a live change cannot touch: everything but the tenants."""
    return {k: v for k, v in config.items() if k != "tenants"}


@dataclass(frozen=True)
class DeployResult:
    """What :func:`deploy` did: ``live`` (tenants only: nothing restarted) or ``redeployed``."""

    mode: str
    tenants_version: str


def deploy(config: AppConfig, address: str | None = "auto") -> DeployResult:
    """Apply ``config`` to the stack running on the cluster at ``address``; return once it is
    in force (a redeploy returns when Serve has the app running again, after any rolls).

    A change of tenants only (keys, priorities, model access, quotas) is published live: every
    router replica enforces it within about a second, no replica restarts and no stream is cut.
    Any other change redeploys the app, and Serve replaces only the deployments whose version
    changed (serve_app.app.deployment_versions): engine arguments roll that model's engines
    behind the same routers, router settings roll the routers and leave the engines; replica
    counts and autoscaling apply in place. New replicas start first, the old ones finish their
    requests (up to the model's drain_timeout_s). The HTTP host and port of a running Serve
    cannot change.
    """
    import ray
    from ray import serve

    from serve_app.app import build_app
    from serve_app.ingress.live_config import read_config

    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False)  # the replicas' logs are not ours to print
    running = read_config(APP_NAME)
    new = config.model_dump(mode="json")
    if running is not None and running["router"]["port"] != config.router.port:
        raise ValueError(f"router.port is {config.router.port} but the running stack serves "
                         f"on {running['router']['port']}; a new port needs a restart")
    if running is not None and _structure(running) == _structure(new):
        return DeployResult("live", _record(config, "live"))
    if running is None:
        # First deploy onto this cluster: Serve's ingress must listen where the config says
        # (serve.run alone would start it on 127.0.0.1, out of reach of the cluster's clients).
        serve.start(**serve_start_options(config))
    version = _record(config, "redeploy")
    serve.run(build_app(config), name=APP_NAME, route_prefix="/", blocking=False)
    return DeployResult("redeployed", version)


def status(address: str | None = "auto") -> dict[str, Any]:
    """The running app: its status, each deployment's replicas by state, the live tenants, and
    per model its engine replicas as a router replica's last load poll saw them (node, requests
    in progress, in the engine's batch and queue, taken since start: how evenly they fill)."""
    import ray
    from ray import serve

    from serve_app.app import ROUTER_DEPLOYMENT
    from serve_app.ingress.budgets import budget_report
    from serve_app.ingress.live_config import read_tenants
    from serve_app.observability.audit import read_audit

    if not ray.is_initialized():
        # Replicas' log lines would otherwise stream into this process's stdout, after the
        # status document a caller parses (seen while an engine replica was starting).
        ray.init(address=address, log_to_driver=False)
    app = serve.status().applications.get(APP_NAME)
    live = read_tenants(APP_NAME)
    return {
        "app": APP_NAME,
        "status": str(getattr(app.status, "value", app.status)) if app else "NOT_RUNNING",
        "deployments": {
            name: {str(getattr(k, "value", k)): n for k, n in d.replica_states.items()}
            for name, d in (app.deployments.items() if app else [])},
        "tenants_version": live[0] if live else None,
        "tenants": [t.name for t in live[1]] if live else [],
        # Per tenant with a token budget: spent and left in the current window, its reset.
        "budgets": budget_report(APP_NAME, live[1]) if live else {},
        # The last deploys: who, when, which config, which tenants changed (never digests).
        "audit": read_audit(APP_NAME, last=5),
        "models": _router_view(app is not None and ROUTER_DEPLOYMENT in app.deployments),
    }


def _router_view(running: bool) -> dict[str, Any]:
    """Per model, a router replica's admission state; {} while no router runs or answers."""
    from ray import serve

    from serve_app.app import ROUTER_DEPLOYMENT
    from serve_app.serve_private import route_on_serve_loop

    if not running:
        return {}
    try:
        # Under RAY_SERVE_THROUGHPUT_OPTIMIZED=1 (inherited by a command started beside the
        # stack) a handle's router runs on the caller's event loop, and a caller without one
        # is refused. A router on Serve's own thread answers from anywhere.
        router = route_on_serve_loop(
            serve.get_deployment_handle(ROUTER_DEPLOYMENT, app_name=APP_NAME))
        # A new driver's first call waits for Serve to tell it the router's replicas.
        return router.admission_state.remote().result(timeout_s=60)
    except Exception as exc:  # a status call must answer while the app is half up
        logger.warning("router admission state unavailable: %s", exc)
        return {}


def stop_stack() -> None:
    """Stop Serve (replicas drain, engines and HAProxy stop), then Ray; then remove whatever of
    theirs did not stop with them."""
    import ray
    from ray import serve

    try:
        # A start that stopped before Ray (a port in use) has no Serve to stop; serve.shutdown()
        # would start a Ray to look for one, or join and stop another stack's on this machine.
        if ray.is_initialized():
            serve.shutdown()
    finally:
        ray.shutdown()
        reap_leftovers()


__all__ = ["DeployResult", "Leftover", "PortInUseError", "base_url", "check_ports", "deploy",
           "find_leftovers", "reap_leftovers", "router_replica_port", "router_replica_ports",
           "serve_start_options", "stack_ports", "start_stack", "status", "stop_stack"]
