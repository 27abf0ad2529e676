"""A pipeline-parallel replica on a two-node Ray cluster, and the loss of its node under a stream.

The vLLM CPU build refuses the Ray executor (test_pipeline_parallel.py pins the refusal), so a
CPU replica cannot put one stage on each node: its two stages run as processes of the replica
on one node (multiprocessing executor). What this covers of the GPU path is the rest: an
operator's `serve-app deploy --address` of deployments/local-cpu-pp2.yaml's shape onto a
cluster of a head (one CPU, router and HAProxy) and a worker (two CPUs: the only node that fits
the replica's bundle); the actor and placement-group tables say where the replica and its
bundle are, its process tree where each stage runs; greedy output equals the single-rank
engine's. Then the worker node dies under a stream: every process of the replica ends, the
stream ends with an error event (no hang), and Serve places the replica again when a node of
two CPUs returns, where it serves the same greedy output.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from serve_app.app import llm_server_name

from .conftest import REPO, wait_until
from .load import greedy_completions
from .local_cluster import (actors, alive, app_status, free_port, placement_groups,
                            running_cluster, serve_app_cli)
from .test_pipeline_parallel import PROMPTS

pytestmark = [pytest.mark.integration, pytest.mark.long]

MODEL = "tiny-llama-pp2"
STAGES = ("EngineCore", "Worker_PP0", "Worker_PP1")


@pytest.fixture(scope="module")
def cluster(tiny_model_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("pp-two-nodes") / "cluster.log"
    try:
        with running_cluster(log, {"CLUSTER_CPUS": "1,2"}) as running:
            yield running
    except RuntimeError as err:  # did not start: its log says why
        pytest.fail(str(err))


def _config(path: Path, tiny_model_path: Path, port: int, key: str) -> Path:
    from serve_app.governance.keys import key_digest

    cfg = yaml.safe_load((REPO / "deployments" / "local-cpu-pp2.yaml").read_text())
    model = cfg["models"][0]
    model["path"] = str(tiny_model_path)
    model["engine_stall_timeout_s"] = 10.0
    cfg["router"] = {**cfg["router"], "port": port, "proxy_location": "HeadOnly",
                     "resources": {"head": 0.01}}
    cfg["tenants"] = [{"name": "team-a", "api_key_sha256": [key_digest(key)]}]
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _replica_on(cluster: dict) -> dict | None:
    """The engine replica (actor id, node, pid, placement group and its bundles' nodes and
    resources), or None while there is none."""
    engines = [a for a in actors(cluster)
               if a["class"].startswith(f"ServeReplica:llm:{llm_server_name(MODEL)}")]
    if not engines:
        return None
    (engine,) = engines
    groups = {g["id"]: g for g in placement_groups(cluster)}
    return {**engine, "bundles": groups.get(engine["placement_group"], {}).get("bundles")}


def _stages(pid: int) -> dict[str, int]:
    """Engine processes under the replica process ``pid``: role -> pid."""
    import psutil

    found = {}
    for child in psutil.Process(pid).children(recursive=True):
        try:
            title = " ".join(child.cmdline())
        except psutil.NoSuchProcess:
            continue
        found.update({role: child.pid for role in STAGES if f"VLLM::{role}" in title})
    return found


def _greedy(base: str, model: str, headers: dict[str, str] | None = None) -> list[tuple]:
    return greedy_completions(base, model, PROMPTS, headers)


def test_pp2_replica_on_the_worker_node_then_the_node_dies_under_a_stream(
        stack, cluster, tiny_model_path, tmp_path):
    from serve_app.governance.keys import new_key

    port, key = free_port(), new_key()
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {key}"}
    t0 = time.monotonic()
    serve_app_cli("deploy", "--config", str(_config(tmp_path / "pp2.yaml", tiny_model_path,
                                                    port, key)),
                  "--address", cluster["address"])

    def serves() -> bool:
        try:
            return httpx.post(f"{base}/v1/completions", headers=auth, timeout=60, json={
                "model": MODEL, "prompt": "pp", "max_tokens": 2}).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(serves, 600, 1)
    served_after = time.monotonic() - t0
    worker = cluster["worker"]
    replica = _replica_on(cluster)
    stages = _stages(replica["pid"])
    print(f"\nPP=2 replica {json.dumps(replica)}; processes {stages}; serving "
          f"{served_after:.1f} s after `serve-app deploy`")
    # The replica and its one bundle (a CPU per stage) on the worker: the only node with two.
    assert replica["node"] == worker
    assert replica["bundles"] == [{"node": worker, "resources": {"CPU": 2.0}}], replica
    assert set(stages) == set(STAGES), stages
    assert _greedy(base, MODEL, auth) == _greedy(stack["base"], stack["model"],
                                                 stack["headers"])

    # The worker node dies under a long stream.
    out: dict = {}
    started = threading.Event()

    def stream() -> None:
        with httpx.Client(base_url=base, timeout=300, headers=auth) as c, c.stream(
                "POST", "/v1/completions", json={"model": MODEL, "prompt": "node loss",
                                                 "stream": True, "max_tokens": 1900,
                                                 "ignore_eos": True}) as r:
            out["status"], out["events"] = r.status_code, []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out["events"].append(line[6:])
                    started.set()
        started.set()

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    assert started.wait(60), "the stream never started"
    procs = {replica["pid"], *stages.values()}
    removed = False
    try:
        assert cluster["control"]("remove-worker") == {"removed": worker}
        removed, t_kill = True, time.monotonic()
        thread.join(120)
        assert not thread.is_alive(), "the stream hung on a lost node"
        stream_ended_after = time.monotonic() - t_kill
        assert out["status"] == 200
        assert "[DONE]" not in out["events"], "a cut-off stream must not look complete"
        assert "error" in json.loads(out["events"][-1]), out["events"][-1]
        wait_until(lambda: not alive(procs), 60, 0.2)
        procs_gone_after = time.monotonic() - t_kill
        wait_until(lambda: (_replica_on(cluster) or {}).get("node") != worker, 60, 0.5)
        replica_gone_after = time.monotonic() - t_kill
    finally:
        if removed:
            new_worker = cluster["control"]("add-worker")["added"]
    t_back = time.monotonic()
    wait_until(lambda: (_replica_on(cluster) or {}).get("node") == new_worker and serves()
               and app_status(cluster)["deployments"].get(llm_server_name(MODEL))
               == {"RUNNING": 1}, 600, 2)
    placed_after = time.monotonic() - t_back
    again = _replica_on(cluster)
    assert again["bundles"] == [{"node": new_worker, "resources": {"CPU": 2.0}}], again
    assert set(_stages(again["pid"])) == set(STAGES)
    assert _greedy(base, MODEL, auth) == _greedy(stack["base"], stack["model"],
                                                 stack["headers"])
    print(f"node lost under a stream: the stream ended with an error event "
          f"{stream_ended_after:.1f} s after the kill, the replica's processes (replica, engine "
          f"core, two stages) gone after {procs_gone_after:.1f} s, the replica out of the "
          f"actor table after {replica_gone_after:.1f} s; placed again and serving "
          f"{placed_after:.1f} s after a node came back (replica {json.dumps(again)})")
