"""`serve-app dashboards --push` against a minimal fake of the two Grafana endpoints it calls
(GET /api/health, POST /api/dashboards/db), through the real grafana-client."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import pytest

from serve_app.cli import main as cli_main
from serve_app.observability.dashboards import DASHBOARDS, render
from serve_app.observability.grafana_push import PushError, push_dashboards

TOKEN = "glsa_test_token"


class _FakeGrafana(BaseHTTPRequestHandler):
    stored: dict[str, dict] = {}
    requests: list[tuple[str, str, str | None]] = []
    healthy = True

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        self.requests.append(("GET", self.path, self.headers.get("Authorization")))
        if self.path == "/api/health":
            self._reply(200, {"database": "ok" if self.healthy else "failing",
                              "version": "11.0.0"})
        else:
            self._reply(404, {"message": "Not found"})

    def do_POST(self) -> None:  # noqa: N802
        self.requests.append(("POST", self.path, self.headers.get("Authorization")))
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self._reply(401, {"message": "Unauthorized"})
            return
        if self.path != "/api/dashboards/db":
            self._reply(404, {"message": "Not found"})
            return
        dash = body["dashboard"]
        if dash["uid"] in self.stored and not body.get("overwrite"):
            self._reply(412, {"message": "A dashboard with the same uid already exists"})
            return
        version = self.stored.get(dash["uid"], {}).get("version", 0) + 1
        self.stored[dash["uid"]] = {"body": body, "version": version}
        self._reply(200, {"id": 1, "uid": dash["uid"], "status": "success", "version": version,
                          "url": f"/d/{dash['uid']}/x"})

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def grafana() -> Iterator[str]:
    _FakeGrafana.stored, _FakeGrafana.requests, _FakeGrafana.healthy = {}, [], True
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeGrafana)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_push_stores_every_committed_dashboard_and_updates_in_place(grafana, monkeypatch):
    monkeypatch.setenv("GRAFANA_TOKEN", TOKEN)
    first = push_dashboards(grafana, folder_uid="serving")
    assert [d.name for d in first] == list(DASHBOARDS) and all(d.version == 1 for d in first)
    for name in DASHBOARDS:
        committed = json.loads(render(name))
        body = _FakeGrafana.stored[committed["uid"]]["body"]
        assert body["dashboard"] == {**committed, "id": None}  # what `make grafana-files` ships
        assert body["overwrite"] is True and body["folderUid"] == "serving"
    assert _FakeGrafana.requests[0] == ("GET", "/api/health", f"Bearer {TOKEN}")
    again = push_dashboards(grafana)  # a re-push updates, it does not fail on the uid
    assert all(d.version == 2 for d in again)
    assert "folderUid" not in next(iter(_FakeGrafana.stored.values()))["body"]


def test_wrong_token_is_a_clear_error_naming_the_fix(grafana):
    with pytest.raises(PushError, match="GRAFANA_TOKEN"):
        push_dashboards(grafana, token="wrong")
    assert not _FakeGrafana.stored


def test_unhealthy_or_unreachable_grafana_is_refused_before_pushing(grafana):
    _FakeGrafana.healthy = False
    with pytest.raises(PushError, match="not a healthy Grafana"):
        push_dashboards(grafana, token=TOKEN)
    assert all(method == "GET" for method, _, _ in _FakeGrafana.requests)
    with pytest.raises(PushError, match="cannot reach"):
        push_dashboards("http://127.0.0.1:9", token=TOKEN)


def test_cli_push_exit_codes(grafana, monkeypatch, capsys):
    monkeypatch.setenv("GRAFANA_TOKEN", TOKEN)
    assert cli_main(["dashboards", "--push", grafana]) == 0
    assert "pushed serving.json" in capsys.readouterr().out
    monkeypatch.setenv("GRAFANA_TOKEN", "wrong")
    assert cli_main(["dashboards", "--push", grafana]) == 1
    assert "Editor role" in capsys.readouterr().err
