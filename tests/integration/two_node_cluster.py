"""A Ray cluster of two nodes on this machine (one CPU each), for the two-node rollout test;
with CLUSTER_GPUS and CLUSTER_CPUS, two GPU nodes on one GPU host (bench/gpu_parallel.sh).

Run as a process of its own, apart from the suite's stack and its Ray:

    python -m tests.integration.two_node_cluster serve     # starts it; prints {"address": ...,
                                                           # "worker": NODE_ID, "dashboard": ...}
                                                           # on one line;
                                                           # stops on stdin EOF; a line
                                                           # `remove-worker` kills the worker
                                                           # node, `add-worker` starts a new
                                                           # one (each answers a JSON line)
    python -m tests.integration.two_node_cluster actors DASHBOARD # alive Serve replicas (JSON)

The nodes are started with ``ray.cluster_utils.Cluster``: the same raylet and GCS processes
``ray start --head`` and ``ray start --address`` start, one raylet per node, but ones this
process can stop alone (``ray stop`` would also stop the suite's Ray on this machine). Every
node gets the environment of the app's data plane, as `cluster.yaml` gives it to ``ray start``,
with the ports Serve fixes by default (HAProxy's stats and metrics, the fallback proxy's) moved
off the ones the suite's stack holds.
"""

from __future__ import annotations

import json
import os
import socket
import sys


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_cluster() -> None:
    from serve_app.app import HIGH_THROUGHPUT_ENV
    from serve_app.ingress import haproxy

    os.environ.update(HIGH_THROUGHPUT_ENV)
    os.environ[haproxy.BINARY_ENV] = str(haproxy.write_wrapper())
    # Ports Serve fixes by default, which the suite's stack on this machine holds already.
    for name in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT",
                 "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT"):
        os.environ[name] = str(_free_port())

    from ray.cluster_utils import Cluster

    # On a host with GPUs (bench/gpu_parallel.sh): CLUSTER_GPUS="0,1" gives the head GPU 0 and
    # the worker GPU 1, one each; a raylet hands its workers the devices it was started with.
    gpus = [g for g in os.environ.get("CLUSTER_GPUS", "").split(",") if g]
    cpus = int(os.environ.get("CLUSTER_CPUS", "1"))

    def node_args(index: int, role: str) -> dict:
        if gpus:
            os.environ["CUDA_VISIBLE_DEVICES"] = gpus[index]  # read by the raylet at its start
        return {"num_cpus": cpus, "num_gpus": 1 if gpus else 0, "resources": {role: 1}}

    dashboard_port = _free_port()  # the state API (actor table) is served by the dashboard
    cluster = Cluster(initialize_head=True, head_node_args={
        **node_args(0, "head"), "include_dashboard": True,
        "dashboard_host": "127.0.0.1", "dashboard_port": dashboard_port})
    worker = cluster.add_node(**node_args(1, "worker"))
    cluster.wait_for_nodes()
    print(json.dumps({"address": cluster.address, "worker": worker.node_id,
                      "dashboard": f"http://127.0.0.1:{dashboard_port}"}), flush=True)
    try:
        for line in sys.stdin:  # until the test closes our stdin
            if line.strip() == "remove-worker":
                # A lost node: its raylet and every process of it killed, no graceful stop.
                node_id = worker.node_id
                cluster.remove_node(worker, allow_graceful=False)
                print(json.dumps({"removed": node_id}), flush=True)
            elif line.strip() == "add-worker":
                worker = cluster.add_node(**node_args(1, "worker"))
                cluster.wait_for_nodes()
                print(json.dumps({"added": worker.node_id}), flush=True)
    finally:
        cluster.shutdown()


def actors(dashboard: str) -> None:
    """Alive Serve replica actors from the cluster's actor table: class, actor id, node, pid."""
    from ray.util.state import list_actors

    print(json.dumps([
        {"class": a.class_name, "id": a.actor_id, "node": a.node_id, "pid": a.pid}
        for a in list_actors(address=dashboard, filters=[("state", "=", "ALIVE")], limit=1000)
        if a.class_name.startswith("ServeReplica:")]))


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve_cluster()
    else:
        actors(sys.argv[2])
