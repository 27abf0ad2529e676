"""What a local Ray of this stack is started with so that it keeps to itself (issue 41 item 5).

`serve-app run` (and the integration suite) start a Ray of their own (``ray.init(address=
"local")``). Ray's dashboard and jobs API run code for whoever reaches them, and so do the
GCS, the raylet and every worker's gRPC port for whoever holds the cluster token. When the
app's OpenAI endpoint is on loopback, nothing of Ray has a reason to be reachable from another
host either, and every port Ray can bind there is bound there; every port is also behind Ray's
token, pinned on here rather than left to Ray's default.

What Ray 2.60 binds, read from its source (``tests/integration/test_ray_listeners.py`` calls each
port from the host's own address without the token):

* By the node's IP: the GCS, the raylet (node manager and object manager), every core worker
  (the driver, Serve's controller, proxies, replicas, every actor), the dashboard agent's gRPC
  and HTTP servers, its Prometheus exporter (no authentication at all), the runtime-env agent,
  and the dashboard's and autoscaler's metrics servers bind 127.0.0.1 when the node's IP is
  loopback, and every interface (or the node's IP) otherwise.
* ``ray.init(_node_ip_address="127.0.0.1")`` alone does not make the node's IP loopback:
  ``ray.init`` rewrites a loopback address to the host's reachable one
  (``services.resolve_ip_for_localhost``) unless ``ray_constants.ENABLE_RAY_CLUSTER`` is false
  (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read when Ray is imported, which happened long before
  :func:`apply_local_ray_settings` runs). It therefore sets that constant in this process too.
  A node on 127.0.0.1 cannot be joined by another host: only a stack of its own (``address is
  None``) gets these settings.
* Not movable: Serve's inter-deployment gRPC server in every replica binds ``[::]:0``
  whatever the node's IP (``ray/serve/_private/replica.py``); Ray's token interceptor guards it
  (UNAUTHENTICATED without the token). Each ingress replica's own HTTP port (direct ingress,
  behind HAProxy) binds ``router.host``. HAProxy's stats and metrics ports: see
  ``serve_app/ingress/haproxy.py``.
* Token authentication: Ray 2.60 turns it on for a new local cluster when ``RAY_AUTH_MODE`` is
  unset. It is pinned here (``RAY_AUTH_MODE=token`` unless the operator set the variable), so a
  changed default or a Ray started some other way does not open the cluster. Ray's C++ config
  reads the variable once: a driver that sets it after that and starts Ray fails with
  "Authentication token is missing" (its GCS wants the token, the driver thinks auth is off),
  so :func:`apply_local_ray_settings` re-reads Ray's config as Ray itself does when it turns
  token auth on (``authentication_token_setup._enable_token_auth``).

The two private Ray names used (``ray._private.ray_constants.ENABLE_RAY_CLUSTER`` and
``ray._raylet.Config.initialize``) have guard tests in ``tests/unit/test_ray_security.py``.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import MutableMapping
from typing import Any

logger = logging.getLogger(__name__)

AUTH_MODE_ENV = "RAY_AUTH_MODE"
# Ray reads it when it is imported: "0" lets a node's IP be loopback (services.get_node_ip_address).
CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
LOOPBACK = "127.0.0.1"


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and any loopback address (127.0.0.0/8, ::1)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def local_ray_settings(router_host: str, environ: MutableMapping[str, str] | None = None
                       ) -> tuple[dict[str, str], dict[str, Any]]:
    """(environment variables, ``ray.init`` keyword arguments) for a new local Ray whose app
    serves on ``router_host``. Pure: ``environ`` (default ``os.environ``) is only read.

    * ``RAY_AUTH_MODE=token`` unless ``environ`` sets it (the operator's choice is kept);
    * ``dashboard_host`` 127.0.0.1 (the dashboard runs code for whoever reaches it);
    * with a loopback ``router_host``: the node's IP 127.0.0.1 (``_node_ip_address`` and
      ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` for every Ray process), which moves every port Ray
      binds by the node's IP to loopback. A router on another address keeps Ray's own choice of
      node IP (another host may need to reach it: the ports stay behind the token).

    Callers set the variables only where unset and the arguments only where not given
    (:func:`apply_local_ray_settings`)."""
    environ = os.environ if environ is None else environ
    env: dict[str, str] = {}
    if AUTH_MODE_ENV not in environ:
        env[AUTH_MODE_ENV] = "token"
    kwargs: dict[str, Any] = {"dashboard_host": LOOPBACK}
    if is_loopback_host(router_host):
        env[CLUSTER_ENV] = "0"
        kwargs["_node_ip_address"] = LOOPBACK
    return env, kwargs


def apply_local_ray_settings(router_host: str, ray_init: MutableMapping[str, Any]) -> None:
    """Apply :func:`local_ray_settings` to this process before ``ray.init`` starts a new local
    Ray: its variables into ``os.environ`` where unset, its arguments into ``ray_init`` where
    not given, and Ray's import-time reads of those variables refreshed in this process."""
    env, kwargs = local_ray_settings(router_host)
    mode = os.environ.get(AUTH_MODE_ENV)
    if mode is not None and mode.lower() != "token":
        logger.warning("%s=%s is used as set: Ray's ports answer anyone who reaches them "
                       "(unset it, or set it to token)", AUTH_MODE_ENV, mode)
    for key, value in env.items():
        os.environ.setdefault(key, value)
    for key, value in kwargs.items():
        ray_init.setdefault(key, value)
    if AUTH_MODE_ENV in env:
        _reload_ray_config()
    if ray_init.get("_node_ip_address") == LOOPBACK and os.environ.get(CLUSTER_ENV) == "0":
        _allow_loopback_node_ip()


def _reload_ray_config() -> None:
    """Make this process's Ray config read RAY_AUTH_MODE again (Ray's own step when it turns
    token auth on for a new cluster)."""
    from ray._raylet import Config

    Config.initialize("")


def _allow_loopback_node_ip() -> None:
    """Keep ``ray.init`` from rewriting a 127.0.0.1 node IP to the host's reachable address."""
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False
