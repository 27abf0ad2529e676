"""A Ray cluster of two nodes on this machine (one CPU each), for the two-node rollout test.

Run as a process of its own, apart from the suite's stack and its Ray:

    python -m tests.integration.two_node_cluster serve     # starts it; prints {"address": ...,
                                                           # "dashboard": ...} on one line;
                                                           # stops on stdin EOF
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

    dashboard_port = _free_port()  # the state API (actor table) is served by the dashboard
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"head": 1}, "include_dashboard": True,
        "dashboard_host": "127.0.0.1", "dashboard_port": dashboard_port})
    cluster.add_node(num_cpus=1, resources={"worker": 1})
    cluster.wait_for_nodes()
    print(json.dumps({"address": cluster.address,
                      "dashboard": f"http://127.0.0.1:{dashboard_port}"}), flush=True)
    try:
        sys.stdin.read()  # until the test closes our stdin
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
