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


def test_a_wrong_field_fails_rays_validation():
    import pytest
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = _config()
    cfg["available_node_types"]["gpu_1x"]["max_worker"] = 3  # typo of max_workers
    with pytest.raises(Exception):
        validate_config(prepare_config(cfg))


def test_worker_caps_add_up():
    cfg = _config()
    workers = [t for name, t in cfg["available_node_types"].items()
               if name != cfg["head_node_type"]]
    assert all(t["min_workers"] <= t["max_workers"] for t in workers)
    assert cfg["max_workers"] >= sum(t["max_workers"] for t in workers)


def test_one_token_is_shipped_to_every_node_and_never_committed():
    cfg = _config()
    assert cfg["file_mounts"]["/home/ray/.ray/auth_token"] == ".ray-cluster/auth_token"
    assert "/.ray-cluster/" in (REPO / ".gitignore").read_text().split()
    for cmds in (cfg["head_start_ray_commands"], cfg["worker_start_ray_commands"]):
        assert "RAY_AUTH_TOKEN_PATH=/home/ray/.ray/auth_token" in " ".join(cmds)
    makefile = (REPO / "Makefile").read_text()
    assert "cluster-up:" in makefile and ".ray-cluster/auth_token" in makefile


def test_every_node_installs_the_same_pinned_packages():
    cfg = _config()
    assert ":" in cfg["docker"]["image"] and not cfg["docker"]["image"].endswith(":latest")
    setup = cfg["setup_commands"]
    assert any('"vllm==' in c for c in setup), setup  # an exact version, not a range
    assert not any(">=" in c or "<" in c for c in setup), setup
    assert any("--no-deps -e ." in c for c in setup), setup


def test_repository_mount_leaves_out_venv_models_and_git():
    cfg = _config()
    assert ".gitignore" in cfg["rsync_filter"]
    ignored = (REPO / ".gitignore").read_text().split()
    assert ".venv/" in ignored and "/models/" in ignored
    assert "**/.git" in cfg["rsync_exclude"]


def test_only_the_openai_port_is_opened_for_clients():
    rules = _config()["provider"]["security_group"]["IpPermissions"]
    assert [(r["FromPort"], r["ToPort"]) for r in rules] == [(8000, 8000)]
    assert all(rng["CidrIp"] != "0.0.0.0/0" for r in rules for rng in r["IpRanges"])


def test_header_names_only_make_targets_that_exist():
    import re

    header = "".join(line for line in (REPO / "cluster.yaml").read_text().splitlines(True)
                     if line.startswith("#"))
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"make ([a-z][a-z-]+)", header))
    assert targets, header
    for target in targets:
        assert re.search(rf"^{target}:", makefile, re.M), target
