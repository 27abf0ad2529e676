"""Every private Ray Serve (and Ray) API this project uses, in one place.

Each one is here because the public API has no way to do what it does; each has a guard test
in ``tests/unit/test_serve_private.py`` that fails loudly, naming the API, when a Ray upgrade
moves or changes it (Ray is pinned; read those tests before bumping it).

* :func:`with_version`: ``Deployment.options(_internal=True, version=...)``. Serve's public
  API no longer takes versions; without one an imperative deploy counts every deployment as
  changed and replaces every replica (engines too) on every deploy.
* :func:`on_data_plane` / :func:`uses_grpc`: a handle's ``_by_reference`` option and
  ``RAY_SERVE_USE_GRPC_BY_DEFAULT``. A handle keeps the transport default of the process that
  built it (the driver); the router replica must use its own data plane's (gRPC under
  ``RAY_SERVE_THROUGHPUT_OPTIMIZED``): as Ray actor calls a stream's first item took
  1.9-2.2 ms against 0.9-1.1 ms over gRPC (bench/RESULTS.md 12c).
* :func:`route_on_serve_loop`: ``DeploymentHandle._init(_run_router_in_separate_loop=True)``,
  so a caller without an event loop can use a handle under the throughput-optimized mode
  (`serve-app status`).
* :data:`PowerOfTwoChoicesRequestRouter`: Serve's default replica choice, which the public
  ``ray.serve.request_router`` does not export; the LLMServer's request router reuses it.
* :func:`probe_queue_lens`: ``RequestRouter._probe_queue_lens``, Serve's own bounded probe of
  replicas' queue lengths (it also refreshes the router's queue-length cache). The
  prefix-affinity policy compares the candidates' loads, and the public cache forgets a replica
  that has not been chosen for 10 s: without a probe a hot prefix's replica looked alone.
* :func:`request_backoff`: ``PendingRequest.routing_context.should_backoff`` (Serve's
  ``RequestRoutingContext``). A request router that offered every candidate and was refused by
  all sets it so that Serve's routing loop backs off before asking again; without it Serve asks
  again at once, in a busy loop.
* :func:`broadcast_each`: ``DeploymentHandle.broadcast`` with each replica's answer bounded on
  its own (``DeploymentBroadcastResponse._fetch_replica_results_async`` and each
  ``ReplicaResult.get_async``): the public ``results_async`` bounds the whole broadcast, so one
  slow replica failed the poll of every replica.
* :func:`reload_ray_config`: ``ray._raylet.Config.initialize``, which makes a driver's Ray
  config read ``RAY_AUTH_MODE`` again after the stack pins it (serve_app/ray_security.py).
* :func:`kv_put` / :func:`kv_get` / :func:`kv_list` / :func:`kv_del`: Ray's internal key-value
  store (the GCS), where the live tenant list, the last deployed config, the audit log and the
  tenants' token budget spend live (``ray.experimental.internal_kv``).
* :func:`replica_placement_groups` / :func:`autoscaler_node_types`: the names Serve gives its
  replicas' placement groups (``ReplicaID.to_full_id_str``), read from
  ``ray.util.placement_group_table``, whose ``stats.scheduling_state`` is ``INFEASIBLE`` from
  the GCS's first scheduling attempt when no node of the cluster can hold the group; and the
  autoscaler's node types (``ray._private.state.state.get_cluster_config``, as Ray Data reads
  them). Serve itself says a replica cannot be scheduled only after 30 s
  (``SLOW_STARTUP_WARNING_S``): a model that can never be placed waited the whole
  ``cold_start_timeout_s`` (issue 41 item 7).
"""

from __future__ import annotations

import asyncio
from typing import Any

from ray.serve._private.constants import RAY_SERVE_USE_GRPC_BY_DEFAULT
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.deployment import Deployment
from ray.serve.handle import DeploymentHandle

_KV_NAMESPACE = "serve_app"


def with_version(deployment: Deployment, version: str) -> Deployment:
    """``deployment`` with Serve's code version set to ``version``: a redeploy replaces its
    replicas only when the version changes, and applies option changes in place."""
    return deployment.options(_internal=True, version=version)


def on_data_plane(handle: DeploymentHandle) -> DeploymentHandle:
    """``handle`` with the transport of this process's Serve data plane (gRPC in the
    throughput-optimized mode), whatever the process that built it used."""
    return handle.options(_by_reference=not RAY_SERVE_USE_GRPC_BY_DEFAULT)


def uses_grpc(handle: DeploymentHandle) -> bool:
    """Whether calls through ``handle`` go over Serve's gRPC transport."""
    return not handle.handle_options._by_reference


def route_on_serve_loop(handle: DeploymentHandle) -> DeploymentHandle:
    """Make ``handle`` route its calls on Serve's own thread, unless it already routes (a
    handle this process already uses keeps its setting). Returns ``handle``."""
    if not handle.is_initialized:
        handle._init(_run_router_in_separate_loop=True)
    return handle


async def broadcast_each(handle: DeploymentHandle, method: str, *args: Any,
                         timeout_s: float, answer_timeout_s: float | None = None) -> list[Any]:
    """Call ``method`` on every replica ``handle`` knows; each answer (or its exception) in its
    place. Answers wait together up to ``answer_timeout_s`` (default ``timeout_s``): a call
    still unanswered then is cancelled and its place holds an ``asyncio.TimeoutError``, so one
    slow replica costs the caller that deadline, not its own delay. Raises
    ``ray.serve.exceptions.DeploymentUnavailableError`` when the deployment has no replica,
    ``asyncio.TimeoutError`` when the call cannot even be sent within ``timeout_s``."""
    response = handle.broadcast(method, *args)
    replica_results = await asyncio.wait_for(response._fetch_replica_results_async(), timeout_s)
    tasks = [asyncio.ensure_future(r.get_async()) for r in replica_results]
    if not tasks:
        return []
    try:
        await asyncio.wait(tasks, timeout=timeout_s if answer_timeout_s is None
                           else answer_timeout_s)
    finally:
        for task in tasks:  # late (or the caller was cancelled): the call is given up
            if not task.done():
                task.cancel()
    answers: list[Any] = []
    for task in tasks:
        if not task.done() or task.cancelled():  # cancelled just now: late
            answers.append(asyncio.TimeoutError())
        elif task.exception() is not None:
            answers.append(task.exception())
        else:
            answers.append(task.result())
    return answers


async def probe_queue_lens(router: Any, replicas: list[Any]) -> list[tuple[Any, int | None]]:
    """(replica, queue length or None) for each of ``replicas``, asked now with Serve's
    response deadline (0.1 s by default); None for a replica that did not answer in time.
    ``router`` is the Serve ``RequestRouter`` the replicas belong to."""
    return await router._probe_queue_lens(replicas, 0)


def request_backoff(pending_request: Any) -> None:
    """Make Serve's routing loop back off (``initial_backoff_s``, growing) before it asks the
    request router again for ``pending_request``, once the replicas chosen this time all
    refused it. ``pending_request`` is Serve's ``PendingRequest``."""
    pending_request.routing_context.should_backoff = True


def reload_ray_config() -> None:
    """Make this process's Ray config read ``RAY_AUTH_MODE`` again (``ray._raylet.Config.
    initialize("")``, Ray's own step when it turns token auth on for a new local cluster:
    ``authentication_token_setup._enable_token_auth``). Ray's C++ config reads the variable once;
    a driver that sets it later and starts Ray fails with "Authentication token is missing"."""
    from ray._raylet import Config

    Config.initialize("")


def kv_put(key: str, value: bytes) -> None:
    """Store ``value`` under ``key`` in the cluster's key-value store (needs a connected Ray
    driver or worker); it outlives every replica."""
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(key.encode(), value, overwrite=True, namespace=_KV_NAMESPACE)


def kv_get(key: str) -> bytes | None:
    """The value stored under ``key``, or None."""
    from ray.experimental.internal_kv import _internal_kv_get

    raw: Any = _internal_kv_get(key.encode(), namespace=_KV_NAMESPACE)
    return raw or None


def kv_del(key: str) -> None:
    """Delete ``key`` from the cluster's key-value store (nothing if it is absent)."""
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del(key.encode(), namespace=_KV_NAMESPACE)


def kv_list(prefix: str) -> list[str]:
    """The keys stored under ``prefix`` (each router replica's budget record of a tenant)."""
    from ray.experimental.internal_kv import _internal_kv_list

    return [k.decode() if isinstance(k, bytes) else str(k)
            for k in _internal_kv_list(prefix.encode(), namespace=_KV_NAMESPACE)]


def replica_placement_groups(app: str, deployment: str) -> list[dict[str, Any]]:
    """The placement groups of ``deployment``'s replicas in ``app`` as
    ``ray.util.placement_group_table`` gives them (``state``, ``strategy``, ``bundles``: index
    -> resources, ``stats.scheduling_state``); one GCS call. Needs a connected Ray worker."""
    from ray.serve._private.common import ReplicaID
    from ray.util import placement_group_table

    groups = []
    for group in placement_group_table().values():
        name = group.get("name") or ""
        if not ReplicaID.is_full_id_str(name):
            continue
        try:
            rid = ReplicaID.from_full_id_str(name)
        except (AssertionError, ValueError):
            continue
        if rid.deployment_id.app_name == app and rid.deployment_id.name == deployment:
            groups.append(group)
    return groups


def autoscaler_node_types() -> list[dict[str, float]] | None:
    """Per-node resources of each node type the cluster's autoscaler may add, as the v2
    autoscaler (``ray up``'s default) reports them to the GCS; None when none is reported: a
    fixed cluster, or a v1 autoscaler, which says nothing of its node types (Ray's own monitor
    runs read-only on every head, so its status key cannot tell one that may add nodes)."""
    import ray._private.state

    config = ray._private.state.state.get_cluster_config()
    if config is None or not config.node_group_configs:
        return None
    return [{k: float(v) for k, v in group.resources.items()}
            for group in config.node_group_configs if group.max_count != 0 and group.resources]


__all__ = ["PowerOfTwoChoicesRequestRouter", "autoscaler_node_types", "broadcast_each",
           "kv_del", "kv_get", "kv_list", "kv_put", "on_data_plane", "probe_queue_lens",
           "reload_ray_config", "replica_placement_groups", "request_backoff",
           "route_on_serve_loop", "uses_grpc", "with_version"]
