"""Placement of one LLMServer replica: the Ray resource bundles its engine spans.

One replica = one engine = TP x PP ranks. Serve reserves the replica's placement group before the
replica starts, puts the replica actor in bundle 0 and makes the group the replica's "current"
placement group; what the bundles hold depends on who runs the engine's ranks
(``ModelSettings.executor_backend``):

- ``uni`` (one GPU rank) and ``mp`` (ranks as processes on the replica's node): the replica actor
  holds every GPU itself, in one bundle; the engine's processes inherit them.
- ``ray``: one bundle of one GPU per rank, in rank order (pipeline stage-major, then tensor rank);
  the replica actor sits in bundle 0 without a GPU, and the vLLM adapter hands the group to vLLM's
  Ray executor, which starts one worker per GPU bundle inside it (no second reservation). The
  strategy decides whether a replica may span nodes: PACK fills one node and spills to others
  when it is too small; STRICT_PACK keeps it on one node.
- CPU engines run inside the replica's node: one bundle holds all its CPUs. Several ranks
  (TP or PP) are worker processes of the replica (the vLLM CPU build refuses the Ray executor),
  one core each: give the replica a CPU per rank. A CPU replica therefore never spans nodes;
  tests/integration/test_pipeline_parallel*.py check where its stages run.

vLLM orders its Ray workers by node (the driver's node first) and gives consecutive ranks to the
workers of one node, so a tensor-parallel group stays on one node exactly when every node holds a
multiple of TP of the replica's GPU bundles (:func:`split_tensor_parallel_groups` checks the
placement Ray chose).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable

from serve_app.config import ModelSettings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaPlacement:
    """Ray options of one replica: actor resources, bundles and strategy."""

    actor_num_cpus: float
    actor_num_gpus: float
    bundles: list[dict[str, float]]
    strategy: str

    def deployment_options(self) -> dict[str, object]:
        """Keyword arguments for ``serve.deployment(...).options(...)``."""
        return {
            "ray_actor_options": {"num_cpus": self.actor_num_cpus, "num_gpus": self.actor_num_gpus},
            "placement_group_bundles": self.bundles,
            "placement_group_strategy": self.strategy,
        }


def replica_placement(settings: ModelSettings) -> ReplicaPlacement:
    """The placement of one replica of ``settings``' model (pure; see the module docstring)."""
    cpus = float(settings.cpus_per_replica)
    if settings.device == "cpu":
        return ReplicaPlacement(cpus, 0.0, [{"CPU": cpus}], settings.placement_strategy)
    world = float(settings.world_size)
    if settings.executor_backend in ("uni", "mp"):
        # The engine's processes run in the replica's process tree: the actor holds the GPUs.
        return ReplicaPlacement(cpus, world, [{"CPU": cpus, "GPU": world}],
                                settings.placement_strategy)
    # Ray executor: one worker per GPU bundle; the replica actor sits in bundle 0 without a GPU.
    bundles: list[dict[str, float]] = [{"CPU": cpus, "GPU": 1.0}]
    bundles += [{"GPU": 1.0} for _ in range(settings.world_size - 1)]
    return ReplicaPlacement(cpus, 0.0, bundles, settings.placement_strategy)


def split_tensor_parallel_groups(gpu_bundle_nodes: Iterable[str], tensor_parallel_size: int,
                                 ) -> dict[str, int]:
    """Nodes whose share of a replica's GPU bundles is not a multiple of TP, with that share.

    Empty when every tensor-parallel group of the engine lies on one node (see the module
    docstring for why node shares decide it). ``gpu_bundle_nodes`` is the node id of each GPU
    bundle of the replica's placement group.
    """
    counts = Counter(gpu_bundle_nodes)
    return {node: n for node, n in counts.items() if n % tensor_parallel_size}


def replica_placement_group(tensor_parallel_size: int) -> Any:
    """The placement group Serve reserved for this replica, for vLLM's Ray executor.

    vLLM's engine core runs in a child process that joins the cluster as a new driver, where
    Ray's "current placement group" is unset; left alone, its executor would reserve world-size
    GPUs of its own while this replica already holds them, and wait forever on one GPU host.
    Handing it the group makes it start one worker per GPU bundle inside it (as Ray Serve LLM
    does). None outside a placement group (a bare engine): vLLM then reserves its own.
    """
    import ray
    from ray.util import get_current_placement_group, placement_group_table

    group = get_current_placement_group() if ray.is_initialized() else None
    if group is None:
        logger.warning("no placement group around this engine; vLLM's Ray executor reserves one")
        return None
    table = placement_group_table(group)
    gpu_nodes = [table["bundles_to_node_id"][i] for i, b in table["bundles"].items()
                 if b.get("GPU", 0) > 0]
    split = split_tensor_parallel_groups(gpu_nodes, tensor_parallel_size)
    if split:
        # vLLM only warns too; the engine works, with TP all-reduces over the network.
        logger.warning(
            "tensor-parallel groups span nodes (GPU bundles per node %s are not multiples of "
            "tensor_parallel_size=%d): free whole nodes, or use placement_strategy: STRICT_PACK "
            "when one node can hold the replica", split, tensor_parallel_size)
    logger.info("vLLM's Ray executor uses this replica's placement group %s (%d GPU bundles)",
                group.id.hex(), len(gpu_nodes))
    return group
