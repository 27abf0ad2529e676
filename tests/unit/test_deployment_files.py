"""Every config under deployments/ loads and yields the bundles and engine arguments of its
topology. A new file must be added to EXPECTED (so each topology is checked, not just parsed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from serve_app.app import llm_server_options
from serve_app.config import load_config
from serve_app.engine.vllm_adapter import engine_args_for

DEPLOYMENTS = Path(__file__).resolve().parents[2] / "deployments"
ONE_GPU = {"GPU": 1.0}

# file -> (replica bundles, strategy, actor GPUs, executor backend in engine args, TP, PP,
#          (min, max) replicas)
EXPECTED = {
    "local-cpu.yaml": ([{"CPU": 1.0}], "PACK", 0.0, None, 1, 1, (1, 1)),
    "local-cpu-pp2.yaml": ([{"CPU": 2.0}], "PACK", 0.0, "mp", 1, 2, (1, 1)),
    "local-cpu-lora.yaml": ([{"CPU": 1.0}], "PACK", 0.0, None, 1, 1, (1, 1)),
    "gpu-1.yaml": ([{"CPU": 2.0, "GPU": 1.0}], "PACK", 1.0, None, 1, 1, (1, 1)),
    "gpu-tp2.yaml": ([{"CPU": 2.0, "GPU": 1.0}, ONE_GPU], "STRICT_PACK", 0.0, "ray", 2, 1,
                     (1, 1)),
    "gpu-pp2-2nodes.yaml": ([{"CPU": 2.0, "GPU": 1.0}, ONE_GPU], "PACK", 0.0, "ray", 1, 2,
                            (1, 1)),
    "gpu-2replicas.yaml": ([{"CPU": 2.0, "GPU": 1.0}], "PACK", 1.0, None, 1, 1, (1, 2)),
    "gpu-70b-tp8-pp2.yaml": ([{"CPU": 8.0, "GPU": 1.0}] + [ONE_GPU] * 15, "PACK", 0.0, "ray",
                             8, 2, (1, 1)),
    "kuberay/llama-pp2.yaml": ([{"CPU": 2.0, "GPU": 1.0}, ONE_GPU], "PACK", 0.0, "ray", 1, 2,
                               (1, 1)),
}
# YAML under deployments/ that is not an app config (checked by tests/unit/test_kuberay.py).
NOT_APP_CONFIGS = {"kuberay/rayservice.yaml"}


def test_every_deployment_file_is_checked():
    found = {str(p.relative_to(DEPLOYMENTS)) for p in DEPLOYMENTS.rglob("*.yaml")}
    assert sorted(found - NOT_APP_CONFIGS) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_deployment_file_topology(name, tmp_path, monkeypatch):
    bundles, strategy, actor_gpus, backend, tp, pp, replicas = EXPECTED[name]
    if name.startswith("kuberay/"):
        # The RayService's pods read their tenants from the mounted Secret (test_kuberay.py).
        from serve_app.config import TENANTS_FILE_ENV

        tenants = tmp_path / "tenants.yaml"
        tenants.write_text("tenants:\n  - name: team-a\n    api_key_sha256: [" + "a" * 64 + "]\n")
        monkeypatch.setenv(TENANTS_FILE_ENV, str(tenants))
    if name == "local-cpu-lora.yaml":
        # Its adapter folder is written by `make model`, which unit tests do not need; the
        # folder check has its own tests (test_lora_config.py).
        from serve_app.config import app as config_app

        monkeypatch.setattr(config_app, "check_adapter_folders", lambda cfg, source: None)
    cfg = load_config(DEPLOYMENTS / name)
    (model,) = cfg.models
    if model.adapters:
        assert engine_args_for(model)["enable_lora"] is True
    opts = llm_server_options(model)
    assert opts["placement_group_bundles"] == bundles
    assert opts["placement_group_strategy"] == strategy
    assert opts["ray_actor_options"]["num_gpus"] == actor_gpus
    args = engine_args_for(model)
    assert args.get("distributed_executor_backend") == backend
    assert (args["tensor_parallel_size"], args["pipeline_parallel_size"]) == (tp, pp)
    assert args["model"] == model.path and Path(model.path).is_absolute()
    assert args["scheduling_policy"] == "priority"
    auto = model.autoscaling
    assert (auto.min_replicas, auto.max_replicas) == replicas
    # Every shipped config is safe to start as is: loopback unless it names tenants (the
    # RayService's app: from its Secret). None opens an endpoint on purpose.
    assert cfg.router.host == "127.0.0.1" or cfg.tenants
    assert not cfg.router.allow_open_endpoint
