"""Placement of one LLMServer replica: the Ray resource bundles its engine spans.

One replica = one engine = TP x PP ranks. On GPUs each rank gets a bundle of one GPU; the replica
actor itself lives in bundle 0 (with the CPU it needs), and vLLM's Ray executor places its workers
in the replica's placement group, so the strategy decides whether a replica may span nodes
(PACK: fill one node, spill to others when it is too small; STRICT_PACK: one node only).
On CPUs the whole engine runs inside the replica's node, so one bundle holds all its CPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

from serve_app.config import ModelSettings


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
    world = settings.world_size
    if world == 1:
        # The engine runs in the replica's own process tree: the actor holds the GPU.
        return ReplicaPlacement(cpus, 1.0, [{"CPU": cpus, "GPU": 1.0}], settings.placement_strategy)
    # Ray executor: one worker per GPU bundle; the replica actor sits in bundle 0 without a GPU.
    bundles: list[dict[str, float]] = [{"CPU": cpus, "GPU": 1.0}]
    bundles += [{"GPU": 1.0} for _ in range(world - 1)]
    return ReplicaPlacement(cpus, 0.0, bundles, settings.placement_strategy)
