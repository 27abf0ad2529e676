"""The one way to start and stop the stack: `serve-app run`, the integration tests, the GPU tests
and the bench scripts (through `serve-app run`) all come through here.

Starting a local Ray first runs the checks of :mod:`serve_app.preflight` on this machine: what a
killed earlier run left behind (vLLM engine processes, Ray Serve's HAProxy) is removed, and every
port the stack will listen on is checked, so that a taken port fails at once with
:class:`~serve_app.preflight.PortInUseError` (naming the port and the setting that moves it).
Stopping the stack removes the same kind of leftovers of its own.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from serve_app import ray_security
from serve_app.config import APP_NAME, AppConfig
from serve_app.ingress import haproxy
from serve_app.preflight import (  # noqa: F401 (importable from here, as before)
    HAPROXY_CONFIG_MARK,
    VLLM_TITLE_PREFIX,
    Leftover,
    PortInUseError,
    check_ports,
    find_leftovers,
    reap_leftovers,
    stack_ports,
)

logger = logging.getLogger(__name__)

def start_stack(config: AppConfig, address: str | None = None,
                engine_class: str | None = None, **ray_init: Any) -> str:
    """Start Ray (or join ``address``), Serve and the app for ``config``; return its base URL.

    Returns once Serve runs the app: ``serve.run`` waits for every deployment's replicas, so the
    models kept warm have loaded (a client elsewhere waits with :func:`wait_until_serving`).
    ``ray_init`` adds ``ray.init`` arguments (tests: ``num_cpus``). Starting a local Ray
    raises :class:`PortInUseError` before Ray starts when a port of the stack is taken."""
    import ray
    from ray import serve

    from serve_app.app import build_app, ray_env
    from serve_app.observability import tracing

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
        # Token authentication pinned on, the dashboard on loopback (serve_app/ray_security.py).
        ray_security.apply_local_ray_settings(ray_init)
    # The dashboard executes code for whoever reaches it: keep it on localhost.
    ray_init.setdefault("dashboard_host", "127.0.0.1")
    # "local": a new Ray of this stack's own, never a `ray start` cluster or a test cluster
    # that happens to run on this machine (ray.init(None) joins one it finds).
    ray.init(address=address or "local", **ray_init)
    serve.start(**serve_start_options(config))
    _record(config, "start")
    # The OTEL_* variables and router.tracing reach every engine replica (runtime_env).
    replicas = tracing.with_replica_env(config)
    app = build_app(replicas) if engine_class is None else build_app(replicas, engine_class)
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    return base_url(config)


def is_ready(base: str) -> bool:
    """Whether ``base`` answers ``GET /ready`` with 200: every model kept warm has a live engine
    replica (:mod:`serve_app.ingress.readiness`; ``/v1/models`` answers before the engines
    load). False while it answers 503 or nothing."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(base + "/ready", timeout=3) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):  # HTTPError (503: loading) is a URLError
        return False


def wait_until_serving(base: str, timeout_s: float = 300.0, interval_s: float = 1.0) -> None:
    """Return once :func:`is_ready`; TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not is_ready(base):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{base} was not ready within {timeout_s:g} s")
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
    """Publish ``config`` and its tenants and add an audit record (``action``: start, live or
    redeploy): :func:`serve_app.governance.live_config.record_deploy`, every deploy path's step."""
    from serve_app.governance.live_config import record_deploy

    return record_deploy(APP_NAME, config, action)


def _structure(config: dict[str, Any]) -> dict[str, Any]:
    """What a live change cannot touch: everything but the tenants and the models' adapters
    (serve_app.app.LIVE_MODEL_FIELDS)."""
    from serve_app.app import LIVE_MODEL_FIELDS

    return {**{k: v for k, v in config.items() if k != "tenants"},
            "models": [{k: v for k, v in m.items() if k not in LIVE_MODEL_FIELDS}
                       for m in config.get("models", [])]}


@dataclass(frozen=True)
class DeployResult:
    """What :func:`deploy` did: ``live`` (tenants only: nothing restarted) or ``redeployed``."""

    mode: str
    tenants_version: str


def deploy(config: AppConfig, address: str | None = "auto") -> DeployResult:
    """Apply ``config`` to the stack running on the cluster at ``address``; return once it is
    in force (a redeploy returns when Serve has the app running again, after any rolls).

    A change of tenants (keys, priorities, model access, quotas) or adapters only is published
    live: every router replica enforces it within about a second, no replica restarts and no
    stream is cut.
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
    from serve_app.governance.live_config import read_config
    from serve_app.observability import tracing

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
    serve.run(build_app(tracing.with_replica_env(config)), name=APP_NAME, route_prefix="/",
              blocking=False)
    return DeployResult("redeployed", version)


def status(address: str | None = "auto") -> dict[str, Any]:
    """The running app: its status, each deployment's replicas by state, the live tenants, and
    per model its engine replicas as a router replica's last load poll saw them (node, requests
    in progress, in the engine's batch and queue, taken since start: how evenly they fill)."""
    import ray
    from ray import serve

    from serve_app.app import ROUTER_DEPLOYMENT
    from serve_app.governance.budgets import budget_report
    from serve_app.governance.live_config import read_adapters, read_tenants
    from serve_app.governance.audit import read_audit

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
        # Per model, the LoRA adapters the routers serve (live, like the tenants).
        "adapters": {model: [a["name"] for a in entries] for model, entries in
                     (read_adapters(APP_NAME) or ("", {}))[1].items() if entries},
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
