"""A Ray cluster of several nodes on this machine, for the multi-node tests: two nodes of one
CPU each for the two-node rollout test; with CLUSTER_GPUS and CLUSTER_CPUS, GPU nodes on one GPU
host (bench/gpu_parallel.sh, tests/gpu/test_node_loss.py).

Run as a process of its own, apart from the suite's stack and its Ray:

    python -m tests.integration.local_cluster serve     # starts it; prints {"address": ...,
                                                        # "worker": NODE_ID, "workers": [...],
                                                        # "dashboard": ...} on one line;
                                                        # stops on stdin EOF; a line
                                                        # `remove-worker [NODE_ID]` kills a
                                                        # worker node (the first one unless
                                                        # named), `add-worker` starts a new
                                                        # one with the devices and CPUs of the
                                                        # last node removed (each answers a
                                                        # JSON line)
    python -m tests.integration.local_cluster actors DASHBOARD   # alive actors (JSON)
    python -m tests.integration.local_cluster placement-groups DASHBOARD  # their bundles' nodes

CLUSTER_GPUS="0,1" makes one node per entry, the head first, each started with that GPU visible
("0,1,0,1": four nodes, two on each of two GPUs); without it, CLUSTER_NODES (default 2) nodes of
no GPU. CLUSTER_CPUS gives every node that many CPUs (default 1), or, as a list, each node its
own ("1,2": a head of one CPU and a worker of two, where only the worker fits a 2-CPU replica).
The nodes are started with ``ray.cluster_utils.Cluster``: the same raylet and GCS
processes ``ray start --head`` and ``ray start --address`` start, one raylet per node, but ones
this process can stop alone (``ray stop`` would also stop the suite's Ray on this machine). Every
node gets the environment of the app's data plane, as `cluster.yaml` gives it to ``ray start``,
with the ports Serve fixes by default (HAProxy's stats and metrics, the fallback proxy's) moved
off the ones the suite's stack holds. The head advertises the custom resource ``head`` and the
workers ``worker`` (``router.resources`` keeps the router on the head).

:func:`running_cluster` starts that process from a test and controls it; :func:`actors` lists
the cluster's actors through its dashboard.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A port nothing else on this machine takes meanwhile (tests/integration/ports.py)."""
    from tests.integration.ports import free_port as quiet_free_port

    return quiet_free_port()


def serve_cluster() -> None:
    from serve_app.app import HIGH_THROUGHPUT_ENV
    from serve_app.ingress import haproxy

    os.environ.update(HIGH_THROUGHPUT_ENV)
    os.environ[haproxy.BINARY_ENV] = str(haproxy.write_wrapper())
    # Ports Serve fixes by default, which the suite's stack on this machine holds already.
    for name in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT",
                 "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT"):
        os.environ[name] = str(free_port())

    from ray.cluster_utils import Cluster

    # On a host with GPUs: one node per CLUSTER_GPUS entry, each given that one GPU; a raylet
    # hands its workers the devices it was started with.
    gpus = [g for g in os.environ.get("CLUSTER_GPUS", "").split(",") if g]
    devices: list[str | None] = list(gpus) or [None] * int(os.environ.get("CLUSTER_NODES", "2"))
    # CLUSTER_CPUS: CPUs of every node ("1"), or of each node, the head first ("1,2").
    cpus = [int(c) for c in os.environ.get("CLUSTER_CPUS", "1").split(",")]
    cpus = cpus * len(devices) if len(cpus) == 1 else cpus
    assert len(cpus) == len(devices), "CLUSTER_CPUS: one entry, or one per node"

    def node_args(device: str | None, role: str, num_cpus: int) -> dict:
        if device is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = device  # read by the raylet at its start
        return {"num_cpus": num_cpus, "num_gpus": 0 if device is None else 1,
                "resources": {role: 1}}

    dashboard_port = free_port()  # the state API (actor table) is served by the dashboard
    cluster = Cluster(initialize_head=True, head_node_args={
        **node_args(devices[0], "head", cpus[0]), "include_dashboard": True,
        "dashboard_host": "127.0.0.1", "dashboard_port": dashboard_port})
    workers = {}  # node id -> (node, its device, its CPUs)
    for device, num_cpus in zip(devices[1:], cpus[1:]):
        node = cluster.add_node(**node_args(device, "worker", num_cpus))
        workers[node.node_id] = (node, device, num_cpus)
    cluster.wait_for_nodes()
    ids = list(workers)
    print(json.dumps({"address": cluster.address, "worker": ids[0], "workers": ids,
                      "dashboard": f"http://127.0.0.1:{dashboard_port}"}), flush=True)
    lost_device, lost_cpus = devices[-1], cpus[-1]
    try:
        for line in sys.stdin:  # until the test closes our stdin
            command, *args = line.split()
            if command == "remove-worker":
                # A lost node: its raylet and every process of it killed, no graceful stop.
                node_id = args[0] if args else next(iter(workers))
                node, lost_device, lost_cpus = workers.pop(node_id)
                cluster.remove_node(node, allow_graceful=False)
                print(json.dumps({"removed": node_id}), flush=True)
            elif command == "add-worker":
                node = cluster.add_node(**node_args(lost_device, "worker", lost_cpus))
                workers[node.node_id] = (node, lost_device, lost_cpus)
                cluster.wait_for_nodes()
                print(json.dumps({"added": node.node_id}), flush=True)
    finally:
        cluster.shutdown()


def list_alive_actors(dashboard: str) -> None:
    """Print the cluster's alive actors (class, actor id, node, pid, placement group) as JSON."""
    from ray.util.state import list_actors

    print(json.dumps([
        {"class": a.class_name, "id": a.actor_id, "node": a.node_id, "pid": a.pid,
         "placement_group": a.placement_group_id}
        # detail=True: without it the placement group column is always None.
        for a in list_actors(address=dashboard, filters=[("state", "=", "ALIVE")], limit=1000,
                             detail=True)]))


def list_placement_groups(dashboard: str) -> None:
    """Print the cluster's created placement groups (id, name, each bundle's node and
    resources) as JSON."""
    from ray.util.state import list_placement_groups as groups

    print(json.dumps([
        {"id": g.placement_group_id, "name": g.name,
         "bundles": [{"node": b.get("node_id"), "resources": b.get("unit_resources")}
                     for b in g.bundles or []]}
        for g in groups(address=dashboard, filters=[("state", "=", "CREATED")], limit=1000,
                        detail=True)]))


def placement_groups(cluster: dict) -> list[dict]:
    """The cluster's created placement groups, as :func:`list_placement_groups` gives them."""
    out = subprocess.run([sys.executable, "-m", "tests.integration.local_cluster",
                          "placement-groups", cluster["dashboard"]], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def actors(cluster: dict) -> list[dict]:
    """The cluster's alive actors, as :func:`list_alive_actors` gives them (from a process of
    its own: the calling test may be connected to another Ray)."""
    out = subprocess.run([sys.executable, "-m", "tests.integration.local_cluster", "actors",
                          cluster["dashboard"]], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def serve_app_cli(*args: str, timeout: float = 300, env: dict[str, str] | None = None
                  ) -> subprocess.CompletedProcess:
    """Run `serve-app ARGS` (the operator's command line); assert it succeeded."""
    done = subprocess.run([sys.executable, "-m", "serve_app.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, f"serve-app {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done


def app_status(cluster: dict, env: dict[str, str] | None = None) -> dict:
    """`serve-app status` on the cluster, parsed (its stdout is one JSON document)."""
    done = serve_app_cli("status", "--address", cluster["address"], timeout=180, env=env)
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError as err:
        raise AssertionError(f"`serve-app status` printed more than its JSON ({err}):\n"
                             f"{done.stdout}\n{done.stderr[-2000:]}") from err


def process_tree(pid: int) -> set[int]:
    """``pid`` and every process under it (a replica and its engine core)."""
    import psutil  # installed with vLLM

    try:
        proc = psutil.Process(pid)
        return {pid, *(c.pid for c in proc.children(recursive=True))}
    except psutil.NoSuchProcess:
        return set()


def alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` that still run (zombies count as gone)."""
    import psutil

    running = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.add(pid)
        except psutil.NoSuchProcess:
            pass
    return running


@contextlib.contextmanager
def running_cluster(log: Path, env: dict[str, str] | None = None) -> Iterator[dict]:
    """Start the cluster process (``env``: CLUSTER_GPUS, CLUSTER_CPUS, CLUSTER_NODES on top of
    this process's environment) and yield its first line, parsed, plus ``control``: a function
    that sends it a command (`remove-worker [NODE_ID]`, `add-worker`) and returns its answer.
    The cluster stops when the block ends."""
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "tests.integration.local_cluster",
                                 "serve"], cwd=REPO, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, text=True,
                                env={**os.environ, **(env or {})})
    line = proc.stdout.readline() if proc.stdout else ""
    if not line:
        proc.kill()
        raise RuntimeError(f"the local cluster did not start:\n{log.read_text()[-3000:]}")

    def control(command: str) -> dict:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(command + "\n")
        proc.stdin.flush()
        answer = proc.stdout.readline()
        assert answer, f"no answer to {command}:\n{log.read_text()[-3000:]}"
        return json.loads(answer)

    try:
        yield {**json.loads(line), "control": control}
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve_cluster()
    elif sys.argv[1] == "placement-groups":
        list_placement_groups(sys.argv[2])
    else:
        list_alive_actors(sys.argv[2])
