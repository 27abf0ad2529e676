"""Placement bundles of one replica for every device, parallelism and executor."""

import pytest

from serve_app.config import ModelSettings
from serve_app.engine.placement import replica_placement, split_tensor_parallel_groups


def _settings(**kw) -> ModelSettings:
    return ModelSettings(name="m", path="/m", **kw)


def test_tp4_pp2_is_eight_one_gpu_bundles_packed():
    p = replica_placement(_settings(tensor_parallel_size=4, pipeline_parallel_size=2))
    assert len(p.bundles) == 8
    assert all(b["GPU"] == 1 for b in p.bundles)
    assert p.strategy == "PACK"
    # The replica actor sits in bundle 0 but leaves every GPU to the engine's Ray workers.
    assert p.actor_num_gpus == 0 and p.bundles[0]["CPU"] == p.actor_num_cpus
    assert sum(b.get("CPU", 0) for b in p.bundles[1:]) == 0


def test_single_gpu_engine_runs_in_the_replica():
    p = replica_placement(_settings(cpus_per_replica=2))
    assert p.bundles == [{"CPU": 2.0, "GPU": 1.0}]
    assert (p.actor_num_cpus, p.actor_num_gpus) == (2.0, 1.0)


def test_single_gpu_with_ray_executor_leaves_the_gpu_to_the_worker():
    """The one-GPU proof of the hand-off: the replica holds no GPU, its Ray worker takes the
    GPU of bundle 0 (a replica holding it too could never start that worker)."""
    p = replica_placement(_settings(distributed_executor_backend="ray"))
    assert p.bundles == [{"CPU": 1.0, "GPU": 1.0}]
    assert p.actor_num_gpus == 0


def test_mp_executor_replica_holds_all_its_gpus_on_one_node():
    p = replica_placement(_settings(tensor_parallel_size=2, distributed_executor_backend="mp"))
    assert p.bundles == [{"CPU": 1.0, "GPU": 2.0}]
    assert p.actor_num_gpus == 2.0


def test_strict_pack_keeps_replica_on_one_node():
    p = replica_placement(_settings(tensor_parallel_size=2, placement_strategy="STRICT_PACK"))
    assert p.strategy == "STRICT_PACK" and len(p.bundles) == 2


def test_cpu_pipeline_stages_share_the_replica_bundle():
    # The stages are processes of the replica (multiprocessing executor): one bundle, one node.
    p = replica_placement(_settings(device="cpu", pipeline_parallel_size=2, cpus_per_replica=2,
                                    engine_kwargs={"compilation_config": {"mode": 2}}))
    assert p.bundles == [{"CPU": 2.0}] and p.actor_num_cpus == 2.0 and p.actor_num_gpus == 0


def test_cpu_engine_one_bundle_of_cpus():
    p = replica_placement(_settings(device="cpu", tensor_parallel_size=2, cpus_per_replica=2))
    assert p.bundles == [{"CPU": 2.0}]
    assert p.actor_num_gpus == 0


def test_deployment_options_shape():
    opts = replica_placement(_settings(tensor_parallel_size=2)).deployment_options()
    assert opts["placement_group_strategy"] == "PACK"
    assert opts["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 0.0}
    assert len(opts["placement_group_bundles"]) == 2


@pytest.mark.parametrize("nodes, tp, split", [
    (["a"] * 8 + ["b"] * 8, 8, {}),                      # 70B: TP=8 x PP=2 on two whole nodes
    (["a"] * 6 + ["b"] * 10, 8, {"a": 6, "b": 10}),     # PACK on a busy cluster
    (["a", "b"], 1, {}),                                 # PP=2 over two nodes, TP=1
    (["a", "a", "b", "b"], 2, {}),
    (["a", "b", "b", "a"], 2, {}),                       # bundle order does not matter
    (["a", "a", "a", "b"], 2, {"a": 3, "b": 1}),
])
def test_tensor_parallel_group_split_across_nodes(nodes, tp, split):
    assert split_tensor_parallel_groups(nodes, tp) == split
