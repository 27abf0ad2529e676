"""On a host with two GPUs: the Ray node of one pipeline stage dies under load.

Four Ray nodes on the host, two on each GPU (tests/integration/local_cluster.py with
CLUSTER_GPUS=0,1,0,1), and two replicas of deployments/gpu-pp2-2nodes.yaml's model, each a
pipeline of two stages on two nodes (STRICT_SPREAD; each stage with 0.42 of its GPU's memory),
so that every node holds one stage and the router sits on the head. Under streamed load, the
worker node that holds the second stage of one replica (not that replica's own actor) is
killed, raylet and all. Then:

- the whole replica goes: its actor, its engine core and both stages' workers end, and the GPU
  memory they held is freed, within 60 s (no half-alive replica holding a GPU, no orphan);
- the other replica keeps serving: only requests in flight on the lost one may fail, each with
  an error its client sees;
- once a node returns, the replica is placed again and takes requests.

The times go to $OUT/node-loss.json (bench/RESULTS.md section 13). Skipped without two GPUs.
Run: python -m pytest -v -s tests/gpu/test_node_loss.py   (bench/gpu_parallel.sh pp2-node-loss)
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

torch = pytest.importorskip("torch")
if torch.cuda.device_count() < 2:
    pytest.skip("needs two GPUs", allow_module_level=True)

from serve_app.app import llm_server_name  # noqa: E402
from tests.integration.conftest import wait_until  # noqa: E402
from tests.integration.load import (  # noqa: E402
    assert_only_in_flight_failed, finish, ok_count, start, streams, whole_requests)
from tests.integration.local_cluster import (  # noqa: E402
    actors, alive, app_status, free_port, process_tree, running_cluster, serve_app_cli)

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]
UTIL = 0.42  # two stages share each GPU


def _nvidia_smi(field: str) -> list[int]:
    """One figure per GPU (MiB), from nvidia-smi's ``--query-gpu``."""
    out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return [int(x) for x in out.split()]


def _gpu_memory_used_mib() -> int:
    return sum(_nvidia_smi("memory.used"))


def _gpu_memory_total_mib() -> int:
    """One GPU's memory (the host's GPUs are alike)."""
    return _nvidia_smi("memory.total")[0]


def _config(path: Path, port: int, replicas: int) -> Path:
    from serve_app.config import load_config
    from serve_app.models import write_model

    source = REPO / "deployments" / "gpu-pp2-2nodes.yaml"
    model_path = load_config(source).models[0].path
    if not Path(model_path).exists():
        write_model("llama-3.1-8b", Path(model_path))
    cfg = yaml.safe_load(source.read_text())
    model = cfg["models"][0]
    model.update(path=str(model_path), placement_strategy="STRICT_SPREAD", max_model_len=4096,
                 autoscaling={"min_replicas": replicas, "max_replicas": replicas})
    model["engine_kwargs"].update(gpu_memory_utilization=UTIL, max_num_seqs=256)
    # The router on the head: losing a worker node costs an engine stage, not a router.
    cfg["router"] = {**cfg["router"], "port": port, "proxy_location": "HeadOnly",
                     "resources": {"head": 0.01}}
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _layout(cluster: dict) -> dict[str, dict]:
    """Per engine replica (its actor id): its actor's node and pid, its placement group, and
    its stages' workers (vLLM's Ray workers in that group) with their nodes and pids."""
    everything = actors(cluster)
    replicas = {a["id"]: {**a, "stages": []} for a in everything
                if a["class"].startswith(f"ServeReplica:llm:{llm_server_name('llama-3.1-8b')}")}
    by_group = {r["placement_group"]: r for r in replicas.values()}
    for a in everything:
        if "RayWorkerWrapper" in a["class"] and a["placement_group"] in by_group:
            by_group[a["placement_group"]]["stages"].append(a)
    return replicas


def _completions(base: str, model: str, n: int) -> None:
    for _ in range(n):
        httpx.post(f"{base}/v1/completions", timeout=60, json={
            "model": model, "prompt": "again", "max_tokens": 2}).raise_for_status()


def test_losing_a_stage_node_tears_that_replica_down_and_the_other_serves(tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    model = "llama-3.1-8b"
    record: dict = {}
    try:
        with running_cluster(tmp_path / "cluster.log", {"CLUSTER_GPUS": "0,1,0,1",
                                                       "CLUSTER_CPUS": "4"}) as cluster:
            # One replica, then two: engines that share a GPU start one after the other (vLLM
            # sizes its KV cache from the memory it finds free, and a neighbour that allocates
            # while it profiles upsets the measurement). Replica counts apply in place.
            for replicas in (1, 2):
                serve_app_cli("deploy", "--config",
                              str(_config(tmp_path / f"app-{replicas}.yaml", port, replicas)),
                              "--address", cluster["address"], timeout=600)
                wait_until(lambda: app_status(cluster)["deployments"].get(
                    llm_server_name(model)) == {"RUNNING": replicas}, 900, 5)
            layout = _layout(cluster)
            assert len(layout) == 2, layout
            stage_nodes = [s["node"] for r in layout.values() for s in r["stages"]]
            assert len(stage_nodes) == 4 and len(set(stage_nodes)) == 4, layout  # a stage per node
            # The victim: a worker node holding a stage of a replica whose actor lies elsewhere.
            victim, node = next((r, s["node"]) for r in layout.values() for s in r["stages"]
                                if s["node"] in cluster["workers"] and s["node"] != r["node"])
            survivor = next(r for r in layout.values() if r["id"] != victim["id"])
            victim_pids = process_tree(victim["pid"]).union(*(process_tree(s["pid"])
                                                              for s in victim["stages"]))
            record["layout"] = {r["id"]: {"actor_node": r["node"],
                                          "stage_nodes": [s["node"] for s in r["stages"]]}
                                for r in layout.values()}
            # The engine replicas as the routers see them (ids of Serve's, not Ray's actors).
            old_replicas = {r["replica"] for r in
                            app_status(cluster)["models"].get(model, {}).get("per_replica", [])}
            used_before = _gpu_memory_used_mib()
            # What the victim's two stages hold: UTIL of a GPU each (weights, KV cache, graphs).
            victim_share = 2 * UTIL * _gpu_memory_total_mib()

            streamed: list = []
            whole: list = []
            stop, threads = start(*[(streams, base, model, {}, streamed) for _ in range(6)],
                                  (whole_requests, base, model, {}, whole))
            removed = False
            try:
                wait_until(lambda: len(streamed) >= 12 and whole, 120, 0.2)
                before = (len(streamed), len(whole))
                assert cluster["control"](f"remove-worker {node}") == {"removed": node}
                removed, t_kill = True, time.monotonic()
                wait_until(lambda: not alive(victim_pids), 60, 0.2)
                record["victim_processes_gone_s"] = time.monotonic() - t_kill
                freed_to = used_before - 0.8 * victim_share
                wait_until(lambda: _gpu_memory_used_mib() <= freed_to, 60, 0.5)
                record["gpu_memory_freed_s"] = time.monotonic() - t_kill
                wait_until(lambda: victim["id"] not in _layout(cluster), 60, 0.5)
                record["replica_out_of_view_s"] = time.monotonic() - t_kill
                assert alive(process_tree(survivor["pid"])), "the other replica went too"

                wait_until(lambda: ok_count(streamed[before[0]:] + whole[before[1]:]) >= 100, 180,
                           0.2)
            finally:
                finish(stop, threads)
                if removed:
                    new_node = cluster["control"]("add-worker")["added"]
            after = streamed[before[0]:] + whole[before[1]:]
            # Only requests in flight on the lost replica may fail, each with a signal.
            failed = assert_only_in_flight_failed(after, len(threads))
            record.update(requests_after_kill=len(after), failed=[str(r) for r in failed])
            assert all(r == (200, True) for r in streamed[:before[0]] + whole[:before[1]])

            t_back = time.monotonic()
            wait_until(lambda: app_status(cluster)["deployments"].get(
                llm_server_name(model)) == {"RUNNING": 2} and len(_layout(cluster)) == 2, 900, 5)
            record["placed_again_s"] = time.monotonic() - t_back
            replaced = next(r for r in _layout(cluster).values() if r["id"] != survivor["id"])
            record["new_replica"] = {"actor_node": replaced["node"], "new_node": new_node,
                                     "stage_nodes": [s["node"] for s in replaced["stages"]]}

            def new_replica_took_requests() -> bool:
                _completions(base, model, 8)  # equally loaded replicas take turns
                view = app_status(cluster)["models"].get(model) or {}
                return any(r["requests_total"] > 0 and r["replica"] not in old_replicas
                           for r in view.get("per_replica", []))

            wait_until(new_replica_took_requests, 180, 1)
    finally:  # what was measured, also when an assertion failed
        print("\n" + json.dumps(record, indent=1))
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "node-loss.json").write_text(json.dumps(record, indent=1))
