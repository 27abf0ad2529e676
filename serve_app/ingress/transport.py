"""How the router's calls reach the LLMServer replicas: over Ray Serve's gRPC transport when
Serve's throughput-optimized data plane is on in the router's process
(``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``, which ``router.high_throughput`` sets on every node),
otherwise as Ray actor calls.

Why it is set here: a deployment handle keeps the transport default of the process that built
it, and the app's handles are built in the driver (``serve-app run``, the tests, the bench
scripts), which imports Ray Serve before the data plane's environment is set. So every
router -> replica call went as a Ray actor call although the router ran on the gRPC data plane:
first item of a stream 1.9-2.2 ms against 0.9-1.1 ms over gRPC (``bench/serve_first_item.py``,
CPU), and a request's TTFT at c=1 carried it (bench/RESULTS.md section 12c).
"""

from __future__ import annotations

from ray.serve._private.constants import RAY_SERVE_USE_GRPC_BY_DEFAULT
from ray.serve.handle import DeploymentHandle


def on_data_plane(handle: DeploymentHandle) -> DeploymentHandle:
    """``handle`` with the transport of this process's Serve data plane (gRPC in the
    throughput-optimized mode), whatever the process that built it used."""
    return handle.options(_by_reference=not RAY_SERVE_USE_GRPC_BY_DEFAULT)


def uses_grpc(handle: DeploymentHandle) -> bool:
    """Whether calls through ``handle`` go over Serve's gRPC transport."""
    return not handle.handle_options._by_reference
