"""deployments/kuberay/rayservice.yaml validates against KubeRay's RayService CRD (v1.7.0) with
unknown fields refused, and its serveConfigV2 against Ray Serve's own config schema."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "deployments" / "kuberay" / "rayservice.yaml"
CRD = REPO.parent / "shared" / "kuberay" / "ray.io_rayservices.yaml"


def _strict(node: Any) -> Any:
    """The CRD's schema with Kubernetes' pruning made an error: an object that lists its
    properties (and does not preserve unknown fields) admits no others, so a typo fails here
    instead of vanishing silently when the API server prunes it."""
    if isinstance(node, dict):
        out = {k: _strict(v) for k, v in node.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


@pytest.fixture(scope="module")
def validator():
    if not CRD.is_file():
        pytest.skip(f"KubeRay's RayService CRD is not at {CRD} (test data beside the checkout)")
    import jsonschema

    crd = yaml.safe_load(CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return jsonschema.Draft7Validator(_strict(version["schema"]["openAPIV3Schema"]))


def _manifest() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


def test_manifest_validates_against_the_crd(validator):
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}"
              for e in validator.iter_errors(_manifest())]
    assert not errors, errors


@pytest.mark.parametrize("path, value", [
    (["spec", "rayClusterConfig", "headGroupSpec", "rayStartParam"], {}),  # typo
    (["spec", "upgradeStrategy", "type"], 3),
    (["spec", "rayClusterConfig", "authOptions", "mode"], "tokens"),
])
def test_a_wrong_field_fails(validator, path, value):
    doc = copy.deepcopy(_manifest())
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert list(validator.iter_errors(doc))


def test_serve_config_validates_with_rays_schema_and_names_a_loadable_app():
    from ray.serve.schema import ServeDeploySchema

    from serve_app.config import load_config

    serve_cfg = ServeDeploySchema.model_validate(
        yaml.safe_load(_manifest()["spec"]["serveConfigV2"]))
    (app,) = serve_cfg.applications
    assert app.import_path == "serve_app.app:app_builder" and app.route_prefix == "/"
    cfg = load_config(REPO / app.args["config"])
    assert cfg.router.host == "0.0.0.0" and cfg.router.port == serve_cfg.http_options.port


def test_every_pod_starts_ray_with_the_data_plane_and_token_auth():
    from serve_app.app import HIGH_THROUGHPUT_ENV
    from serve_app.ingress.haproxy import BINARY_ENV, WRAPPER_NAME

    spec = _manifest()["spec"]
    cluster = spec["rayClusterConfig"]
    assert cluster["authOptions"]["mode"] == "token"
    assert spec["upgradeStrategy"]["type"] == "NewCluster"
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    for group in pods:
        for container in group["template"]["spec"]["containers"]:
            env = {e["name"]: e["value"] for e in container["env"]}
            assert HIGH_THROUGHPUT_ENV.items() <= env.items()
            assert env[BINARY_ENV].endswith("/" + WRAPPER_NAME)
            assert container["image"] == "serve-app:0.1.0"
    # The Dockerfile writes the wrapper where the pods look for it.
    dockerfile = (REPO / "deployments" / "kuberay" / "Dockerfile").read_text()
    wrapper_dir = env[BINARY_ENV].rsplit("/", 1)[0]
    assert f"serve-app haproxy-binary --dir {wrapper_dir}" in dockerfile
    assert '"vllm==0.26.0"' in dockerfile


def test_gpu_workers_hold_the_replicas_stages():
    from serve_app.config import load_config

    spec = _manifest()["spec"]
    serve_cfg = yaml.safe_load(spec["serveConfigV2"])
    cfg = load_config(REPO / serve_cfg["applications"][0]["args"]["config"])
    (model,) = cfg.models
    gpus = sum(int(g["replicas"]) * int(c["resources"]["limits"].get("nvidia.com/gpu", 0))
               for g in spec["rayClusterConfig"]["workerGroupSpecs"]
               for c in g["template"]["spec"]["containers"])
    assert model.pipeline_parallel_size == 2 and gpus >= model.world_size
    head = spec["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"  # engines run on the GPU pods only
