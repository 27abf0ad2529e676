"""cluster.yaml passes Ray's own cluster-launcher schema validation and is secure by default."""

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def _config() -> dict:
    return yaml.safe_load((REPO / "cluster.yaml").read_text())


def test_ray_validates_cluster_yaml():
    from ray.autoscaler._private.util import prepare_config, validate_config

    # prepare_config fills in the launcher's defaults as `ray up` does, then the schema check.
    validate_config(prepare_config(_config()))  # raises on any violation


def test_head_is_cpu_and_workers_have_gpus():
    cfg = _config()
    types = cfg["available_node_types"]
    assert types[cfg["head_node_type"]]["resources"]["GPU"] == 0
    workers = [t for name, t in types.items() if name != cfg["head_node_type"]]
    assert workers and all(t["resources"]["GPU"] >= 1 for t in workers)


def test_dashboard_bound_to_localhost_with_token_auth():
    cfg = _config()
    start = " ".join(cfg["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in start
    for cmds in (cfg["head_start_ray_commands"], cfg["worker_start_ray_commands"]):
        # exported (not a one-command prefix), so `ray start` itself sees them
        assert "export RAY_AUTH_MODE=token" in " ".join(cmds)


def test_nodes_start_with_the_apps_ray_environment():
    from serve_app.app import HIGH_THROUGHPUT_ENV

    cfg = _config()
    for cmds in (cfg["head_start_ray_commands"], cfg["worker_start_ray_commands"]):
        for key, value in HIGH_THROUGHPUT_ENV.items():
            assert f"{key}={value}" in " ".join(cmds)


def test_nodes_start_haproxy_without_kernel_splicing():
    from serve_app.ingress.haproxy import BINARY_ENV

    cfg = _config()
    for cmds in (cfg["head_start_ray_commands"], cfg["worker_start_ray_commands"]):
        assert f"export {BINARY_ENV}=$(serve-app haproxy-binary)" in " ".join(cmds)
