"""What a local Ray of this stack is started with so that it keeps to itself (issue 41 item 5).

`serve-app run` (and the integration suite) start a Ray of their own (``ray.init(address=
"local")``). Ray's dashboard and jobs API run code for whoever reaches them, and so do the
GCS, the raylet and every worker's gRPC port for whoever holds the cluster token. So:

* the dashboard binds 127.0.0.1;
* token authentication is pinned on (``RAY_AUTH_MODE=token`` unless the operator set the
  variable), not left to Ray 2.60's default for a new local cluster, so a changed default or a
  Ray started some other way does not open the cluster. Ray's C++ config reads the variable
  once: a driver that sets it after that and starts Ray fails with "Authentication token is
  missing", so :func:`apply_local_ray_settings` re-reads Ray's config as Ray itself does when
  it turns token auth on (``authentication_token_setup._enable_token_auth``).

What Ray 2.60 binds beyond loopback, and why the rest stays there (``tests/integration/
test_ray_listeners.py`` calls each port from the host's own address without the token):

* The GCS, the raylet (node manager and object manager), every core worker, the dashboard
  agent's gRPC and HTTP servers and the runtime-env agent bind by the node's IP, and all of them
  refuse a caller without the token (UNAUTHENTICATED or HTTP 401). Serve's inter-deployment
  gRPC server in every replica binds ``[::]:0`` whatever the node's IP, behind the same token.
* Three Prometheus exporters answer anyone: the metrics agent's, the dashboard's and the
  autoscaler monitor's. They serve metrics text to a GET and nothing else (Prometheus, perhaps on
  another host, scrapes them), and run no code.
* Not done: putting the node's IP on loopback (``_node_ip_address="127.0.0.1"``, which also
  needs ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``) would move every one of those ports to 127.0.0.1,
  but then every other driver, `serve-app status` included, hangs in ``ray.init`` while it looks
  for a raylet on the host's address (seen here: 90 s and no connection), unless it carries that
  variable too. Each ingress replica's own HTTP port binds ``router.host``; HAProxy's stats and
  metrics ports: ``serve_app/ingress/haproxy.py``.

The private Ray name used (``ray._raylet.Config.initialize``) lives in
:func:`serve_app.serve_private.reload_ray_config`, with its guard test.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from typing import Any

from serve_app.serve_private import reload_ray_config

logger = logging.getLogger(__name__)

AUTH_MODE_ENV = "RAY_AUTH_MODE"
LOOPBACK = "127.0.0.1"


def local_ray_settings(environ: MutableMapping[str, str] | None = None
                       ) -> tuple[dict[str, str], dict[str, Any]]:
    """(environment variables, ``ray.init`` keyword arguments) for a new local Ray of the
    stack. Pure: ``environ`` (default ``os.environ``) is only read.

    * ``RAY_AUTH_MODE=token`` unless ``environ`` sets it (the operator's choice is kept);
    * ``dashboard_host`` 127.0.0.1 (the dashboard runs code for whoever reaches it).

    Callers set the variables only where unset and the arguments only where not given
    (:func:`apply_local_ray_settings`)."""
    environ = os.environ if environ is None else environ
    env: dict[str, str] = {}
    if AUTH_MODE_ENV not in environ:
        env[AUTH_MODE_ENV] = "token"
    return env, {"dashboard_host": LOOPBACK}


def apply_local_ray_settings(ray_init: MutableMapping[str, Any]) -> None:
    """Apply :func:`local_ray_settings` to this process before ``ray.init`` starts a new local
    Ray: its variables into ``os.environ`` where unset, its arguments into ``ray_init`` where
    not given, and Ray's import-time read of ``RAY_AUTH_MODE`` refreshed in this process. An
    operator's ``RAY_AUTH_MODE`` other than ``token`` is used as set, with a warning."""
    env, kwargs = local_ray_settings()
    mode = os.environ.get(AUTH_MODE_ENV)
    if mode is not None and mode.lower() != "token":
        logger.warning("%s=%s is used as set: Ray's ports answer anyone who reaches them "
                       "(unset it, or set it to token)", AUTH_MODE_ENV, mode)
    for key, value in env.items():
        os.environ.setdefault(key, value)
    for key, value in kwargs.items():
        ray_init.setdefault(key, value)
    if AUTH_MODE_ENV in env:
        reload_ray_config()
