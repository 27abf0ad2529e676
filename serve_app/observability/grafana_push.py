"""Push the dashboards to a running Grafana server (``serve-app dashboards --push URL``).

For teams that have a Grafana server rather than a provisioning folder. It calls two endpoints
through ``grafana-client``: ``GET /api/health`` (is this a Grafana, is it up) and
``POST /api/dashboards/db`` once per dashboard, with ``overwrite`` so a re-push updates the
dashboard in place (the dashboards carry fixed uids). The token comes from the environment
(``GRAFANA_TOKEN``: a service-account token with the Editor role), never from the command
line, where other users of the machine could read it; ``http://user:password@host`` works too.

grafana-client is pinned at 3.11.2: its 4.x and 5.x releases depend on niquests and
urllib3-future, which installs its own ``urllib3`` package over the one Ray, requests and the
rest of this environment import.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from serve_app.observability.dashboards import DASHBOARDS, render

TOKEN_ENV = "GRAFANA_TOKEN"


class PushError(Exception):
    """Grafana refused or could not be reached; the message says which and why."""


@dataclass(frozen=True)
class Pushed:
    """One dashboard as Grafana stored it."""

    name: str
    uid: str
    url: str
    version: int


def push_dashboards(url: str, token: str | None = None, folder_uid: str | None = None,
                    message: str = "serve-app dashboards --push") -> list[Pushed]:
    """Create or update every dashboard on the Grafana at ``url``; ``token`` defaults to
    ``$GRAFANA_TOKEN``; ``folder_uid``: an existing folder (default: Grafana's General)."""
    from grafana_client import GrafanaApi
    from grafana_client.client import GrafanaClientError, GrafanaException

    token = token if token is not None else os.environ.get(TOKEN_ENV) or None
    api = GrafanaApi.from_url(url, credential=token, timeout=10)
    try:
        health = api.health.check()
    except GrafanaException as err:
        raise PushError(f"{url} is not a healthy Grafana: {err}") from None
    except OSError as err:  # connection refused, DNS, TLS
        raise PushError(f"cannot reach Grafana at {url}: {err}") from None
    if not isinstance(health, dict) or health.get("database") != "ok":
        raise PushError(f"{url} answered /api/health with {health!r}, not a healthy Grafana")
    pushed = []
    for name in DASHBOARDS:
        dashboard = json.loads(render(name))
        body: dict = {"dashboard": {**dashboard, "id": None}, "overwrite": True,
                      "message": message}
        if folder_uid:
            body["folderUid"] = folder_uid
        try:
            r = api.dashboard.update_dashboard(body)
        except GrafanaClientError as err:
            hint = (f" (set {TOKEN_ENV} to a service-account token with the Editor role)"
                    if err.status_code in (401, 403) else "")
            raise PushError(f"Grafana refused {name}: {err}{hint}") from None
        except GrafanaException as err:
            raise PushError(f"Grafana failed on {name}: {err}") from None
        pushed.append(Pushed(name, r.get("uid", dashboard.get("uid", "")), r.get("url", ""),
                             int(r.get("version", 0))))
    return pushed
