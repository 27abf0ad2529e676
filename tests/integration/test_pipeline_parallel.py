"""Pipeline parallelism 2 inside one Serve replica on the vLLM CPU build.

A second app serves `deployments/local-cpu-pp2.yaml`'s shape: the tiny model split into two
stages of one layer each, run by vLLM's multiprocessing executor as two worker processes under
the replica's engine core, inside the replica's placement group (one bundle, one CPU per stage).
(a) its greedy output equals the suite's single-rank engine's on the same prompts, and the
    actor and placement-group tables say where each stage ran;
(b) a stage that dies under a stream (its process killed, as on a lost node) ends the stream
    with an error event, the replica's other engine processes end, and a new replica serves;
(c) a stage that hangs (stopped: a stage blocked on a lost peer, the stall watch's real case)
    goes the same way, through the stall watch;
(d) the vLLM CPU build refuses the Ray executor, so a CPU replica cannot put its stages on two
    Ray nodes; the test pins the refusal (exact message), so a vLLM that lifts it shows up here.
(b) and (c) restart the replica (a minute and more each on two cores): `make test-long` runs
them, with test_pipeline_parallel_two_nodes.py (the node of a PP replica lost under a stream).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from serve_app.app import llm_server_name

from .conftest import REPO, wait_until
from .load import greedy_completions

pytestmark = [pytest.mark.integration, pytest.mark.long]  # `make test-long`

APP = "pp2"
PREFIX = "/pp2"
MODEL = "tiny-pp2"
PROMPTS = ["The quick brown fox", "Pipeline stages pass activations", "0123456789"]
# The stall watch's floor for this app: short, the tiny model's steps take milliseconds.
STALL_S = 10.0
LONG = {"max_tokens": 1900, "ignore_eos": True}


@pytest.fixture(scope="module")
def pp2(stack):
    from ray import serve

    from serve_app.app import build_app
    from serve_app.config import load_config

    cfg = load_config(REPO / "deployments" / "local-cpu-pp2.yaml")
    model = cfg.models[0].model_copy(update={
        "name": MODEL, "path": str(stack["path"]), "engine_stall_timeout_s": STALL_S})
    cfg = cfg.model_copy(update={"models": [model]})
    serve.run(build_app(cfg), name=APP, route_prefix=PREFIX, blocking=False)
    base = stack["base"] + PREFIX
    wait_until(lambda: _serves(base), 300, 1)
    yield base
    serve.delete(APP)


def _serves(base: str) -> bool:
    try:
        return httpx.post(f"{base}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "hi", "max_tokens": 2}).status_code == 200
    except httpx.HTTPError:
        return False


def _greedy(base: str, model: str, headers: dict[str, str] | None = None) -> list[tuple]:
    return greedy_completions(base, model, PROMPTS, headers)


def replica_layout() -> dict:
    """Where the PP app's one engine replica runs, from Ray's actor and placement-group tables
    and the replica's process tree: the actor (node, pid, placement group and its bundles) and
    each engine process under it (engine core, one worker per stage) with its CPU affinity."""
    import ray
    from ray.util.state import list_actors

    (actor,) = list_actors(filters=[
        ("class_name", "=", f"ServeReplica:{APP}:{llm_server_name(MODEL)}"),
        ("state", "=", "ALIVE")], detail=True)  # detail: the placement group column
    group = actor["placement_group_id"]
    table = ray.util.placement_group_table()[group] if group else None
    procs = {}
    for child in psutil.Process(actor["pid"]).children(recursive=True):
        try:
            title = " ".join(child.cmdline())
            affinity = child.cpu_affinity()
        except psutil.NoSuchProcess:
            continue
        for role in ("EngineCore", "Worker_PP0", "Worker_PP1"):
            if f"VLLM::{role}" in title or title.startswith(role):
                procs[role] = {"pid": child.pid, "ppid": child.ppid(), "cpus": affinity}
    return {"actor": {"id": actor["actor_id"], "node": actor["node_id"], "pid": actor["pid"]},
            "placement_group": group and {
                "id": group, "strategy": table["strategy"], "bundles": table["bundles"],
                "bundle_nodes": table["bundles_to_node_id"]},
            "processes": procs}


def test_pp2_replica_matches_single_rank_greedy_output_in_its_placement_group(stack, pp2):
    t0 = time.monotonic()
    split = _greedy(pp2, MODEL)
    single = _greedy(stack["base"], stack["model"], stack["headers"])
    assert split == single
    assert all(tokens == 24 and text for text, tokens in split)

    layout = replica_layout()
    print(f"\nPP=2 replica layout: {json.dumps(layout)} ({time.monotonic() - t0:.1f} s greedy)")
    _assert_in_its_placement_group(layout)
    # Each stage on its own core (VLLM_CPU_OMP_THREADS_BIND "0|1").
    procs = layout["processes"]
    assert (procs["Worker_PP0"]["cpus"], procs["Worker_PP1"]["cpus"]) == ([0], [1]), procs


def _assert_in_its_placement_group(layout: dict) -> None:
    """The replica runs in the placement group Serve reserved for it: one bundle of one CPU
    per stage, on the replica's node; the engine core and both stages are processes of its
    tree (the multiprocessing executor's ranks use the replica's reservation)."""
    actor, group, procs = layout["actor"], layout["placement_group"], layout["processes"]
    assert group is not None, "the replica runs outside a placement group"
    assert list(group["bundles"].values()) == [{"CPU": 2.0}], group
    assert set(group["bundle_nodes"].values()) == {actor["node"]}, (group, actor)
    assert set(procs) == {"EngineCore", "Worker_PP0", "Worker_PP1"}, procs
    assert procs["EngineCore"]["ppid"] == actor["pid"]
    assert procs["Worker_PP0"]["ppid"] == procs["Worker_PP1"]["ppid"] == procs["EngineCore"]["pid"]


def _stream_until_end(base: str, out: dict, started: threading.Event) -> None:
    with httpx.Client(base_url=base, timeout=300) as client, client.stream(
            "POST", "/v1/completions",
            json={"model": MODEL, "prompt": "a long stream", "stream": True, **LONG}) as r:
        out["status"] = r.status_code
        out["events"] = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                out["events"].append(line[6:])
                started.set()
    started.set()


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# Restarts PP replicas (a minute and more each on two cores): `make test-long`.
@pytest.mark.long
@pytest.mark.parametrize("fault", ["killed", "stopped"])
def test_a_lost_stage_ends_its_streams_and_the_replica_is_replaced(stack, pp2, fault):
    """Stage 1's worker is killed (its node lost) or stopped (blocked on a lost peer) under a
    stream. The stream ends with an error event, not [DONE] and not a hang; every engine
    process of the replica ends; Serve starts a new replica, whose greedy output is the same."""
    before = replica_layout()
    procs = before["processes"]
    victim = procs["Worker_PP1"]["pid"]
    out: dict = {}
    started = threading.Event()
    stream = threading.Thread(target=_stream_until_end, args=(pp2, out, started), daemon=True)
    stream.start()
    assert started.wait(60), "the stream never started"
    os.kill(victim, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
    t_fault = time.monotonic()
    try:
        stream.join(STALL_S * 4 + 120)
        assert not stream.is_alive(), f"the stream hung on a {fault} stage"
        ended_after = time.monotonic() - t_fault
        assert out["status"] == 200
        assert "[DONE]" not in out["events"], "a cut-off stream must not look complete"
        assert "error" in json.loads(out["events"][-1]), out["events"][-1]
        engine_pids = [p["pid"] for p in procs.values()]
        wait_until(lambda: all(_gone(pid) for pid in engine_pids), 120, 0.2)
        procs_gone_after = time.monotonic() - t_fault
    finally:
        if not _gone(victim):  # the test failed: leave no stopped process behind
            os.kill(victim, signal.SIGKILL)
    wait_until(lambda: _serves(pp2), 300, 1)
    served_after = time.monotonic() - t_fault
    after = replica_layout()
    assert after["actor"]["id"] != before["actor"]["id"]
    _assert_in_its_placement_group(after)
    assert _greedy(pp2, MODEL) == _greedy(stack["base"], stack["model"], stack["headers"])
    print(f"\nstage 1 {fault}: stream ended with an error event {ended_after:.1f} s later, the "
          f"replica's engine processes gone after {procs_gone_after:.1f} s, a new replica "
          f"served after {served_after:.1f} s (engine_stall_timeout_s={STALL_S})")


REFUSAL = """
import ray
from vllm.config import ParallelConfig
from vllm.platforms import current_platform
from vllm.v1.executor.ray_utils import initialize_ray_cluster

ray.init()  # RAY_ADDRESS: the suite's Ray
print("ray_device_key", repr(current_platform.ray_device_key), flush=True)
try:
    initialize_ray_cluster(ParallelConfig(pipeline_parallel_size=2,
                                          distributed_executor_backend="ray"))
except ValueError as err:
    print("REFUSED", err, flush=True)
"""


def test_the_cpu_build_refuses_the_ray_executor(stack):
    """What keeps a CPU replica's stages from spanning Ray nodes: vLLM's Ray executor asks
    the platform for its Ray resource name (`ray_device_key`); the CPU platform has none, and
    the executor's start (`initialize_ray_cluster`, reached from RayExecutorV2._init_executor)
    raises. If a vLLM CPU build lifts this, this test fails: the two-node PP test can then run
    (and `distributed_executor_backend: ray` be allowed for device: cpu in config.py)."""
    import ray

    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    done = subprocess.run([sys.executable, "-c", REFUSAL], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ray_device_key ''" in done.stdout, done.stdout
    assert "REFUSED current platform cpu does not support ray." in done.stdout, done.stdout
