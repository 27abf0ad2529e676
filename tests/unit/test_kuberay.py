"""deployments/kuberay/rayservice.yaml validates against KubeRay's RayService CRD (v1.7.0) with
unknown fields refused, and its serveConfigV2 against Ray Serve's own config schema. Its app
takes its tenants from a Secret mounted into the pods, and refuses to serve open without them."""

from __future__ import annotations

import copy
import os
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


TENANT_DIGEST = "b" * 64
SECRET = f"tenants:\n  - name: team-a\n    api_key_sha256: [{TENANT_DIGEST}]\n"


def _pods(doc: dict) -> list[dict]:
    cluster = doc["spec"]["rayClusterConfig"]
    return [g["template"]["spec"] for g in [cluster["headGroupSpec"],
                                            *cluster["workerGroupSpecs"]]]


def _load_as_a_pod(doc: dict, tmp_path: Path, monkeypatch, secrets: dict[str, dict[str, str]]):
    """The app's config as ``serve_app.app:app_builder`` loads it in the head pod of ``doc``:
    with the pod's environment, and each Secret volume of the pod (``secrets``: name -> its
    files; a Secret not given does not exist) mounted under ``tmp_path``."""
    from serve_app.config import load_config

    spec = _pods(doc)[0]
    (container,) = spec["containers"]
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container.get("volumeMounts", [])}
    env = {e["name"]: e["value"] for e in container["env"]}
    for name in [n for n in os.environ if n.startswith("SERVE_APP_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        for mount_path, volume in mounts.items():
            if "secret" in volume and value.startswith(mount_path + "/"):
                files = secrets.get(volume["secret"]["secretName"], {})
                folder = tmp_path / volume["secret"]["secretName"]
                folder.mkdir(exist_ok=True)
                for file, text in files.items():
                    (folder / file).write_text(text)
                value = str(folder / value[len(mount_path) + 1:])
        monkeypatch.setenv(name, value)
    serve_cfg = yaml.safe_load(doc["spec"]["serveConfigV2"])
    return load_config(REPO / serve_cfg["applications"][0]["args"]["config"])


def test_serve_config_validates_with_rays_schema_and_names_a_loadable_app(tmp_path, monkeypatch):
    from ray.serve.schema import ServeDeploySchema

    serve_cfg = ServeDeploySchema.model_validate(
        yaml.safe_load(_manifest()["spec"]["serveConfigV2"]))
    (app,) = serve_cfg.applications
    assert app.import_path == "serve_app.app:app_builder" and app.route_prefix == "/"
    cfg = _load_as_a_pod(_manifest(), tmp_path, monkeypatch,
                         {"serve-app-tenants": {"tenants.yaml": SECRET}})
    # The config's host is the one Serve binds (serveConfigV2), so its open-endpoint check
    # judges the real bind.
    assert cfg.router.host == serve_cfg.http_options.host == "0.0.0.0"
    assert cfg.router.port == serve_cfg.http_options.port
    assert [t.name for t in cfg.tenants] == ["team-a"]
    assert cfg.tenants[0].api_key_sha256 == [TENANT_DIGEST]


def test_every_pod_mounts_the_tenants_secret_and_names_it_to_the_loader():
    from serve_app.config import TENANTS_FILE_ENV

    for spec in _pods(_manifest()):
        (container,) = spec["containers"]
        env = {e["name"]: e["value"] for e in container["env"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        (mount,) = [m for m in container["volumeMounts"]
                    if env[TENANTS_FILE_ENV].startswith(m["mountPath"] + "/")]
        assert mount["readOnly"] is True
        secret = volumes[mount["name"]]["secret"]
        assert secret["secretName"] == "serve-app-tenants"
        assert secret.get("optional", False) is False  # no Secret: the pod does not start


def test_a_manifest_without_tenants_and_without_the_open_flag_fails(tmp_path, monkeypatch):
    """The app binds 0.0.0.0: with no tenants it must refuse to run unless its config says
    `router.allow_open_endpoint: true`, as for any non-loopback `router.host`."""
    from serve_app.config import TENANTS_FILE_ENV, ConfigError

    doc = copy.deepcopy(_manifest())
    for spec in _pods(doc):  # the tenants' Secret and its variable taken out
        for container in spec["containers"]:
            container["env"] = [e for e in container["env"] if e["name"] != TENANTS_FILE_ENV]
    with pytest.raises(ConfigError, match="router.host is '0.0.0.0' and no tenants"):
        _load_as_a_pod(doc, tmp_path, monkeypatch, {})
    # The Secret named but missing (a pod would not start; the loader says which file).
    with pytest.raises(ConfigError, match=f"{TENANTS_FILE_ENV}=.*no such file"):
        _load_as_a_pod(_manifest(), tmp_path, monkeypatch, {})
    # A Secret with no tenants in it is no way around the check either.
    with pytest.raises(ConfigError, match="no tenants"):
        _load_as_a_pod(_manifest(), tmp_path, monkeypatch,
                       {"serve-app-tenants": {"tenants.yaml": "tenants: []\n"}})


def test_an_app_config_that_says_open_runs_open(tmp_path, monkeypatch):
    """The explicit flag is the one way to serve without tenants."""
    from serve_app.config import TENANTS_FILE_ENV, load_config

    app_cfg = yaml.safe_load((REPO / "deployments/kuberay/llama-pp2.yaml").read_text())
    app_cfg["router"]["allow_open_endpoint"] = True
    path = tmp_path / "deployments" / "open.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(app_cfg))
    monkeypatch.delenv(TENANTS_FILE_ENV, raising=False)
    cfg = load_config(path)
    assert cfg.router.allow_open_endpoint and not cfg.tenants


def test_a_tenants_file_joins_the_configs_tenants_and_is_validated(tmp_path, monkeypatch):
    from serve_app.config import TENANTS_FILE_ENV, ConfigError, load_config

    config = tmp_path / "app.yaml"
    config.write_text(yaml.safe_dump({
        "models": [{"name": "m", "path": "/m"}],
        "tenants": [{"name": "team-z", "api_key_sha256": ["c" * 64]}]}))
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(SECRET)
    monkeypatch.setenv(TENANTS_FILE_ENV, str(tenants))
    assert [t.name for t in load_config(config).tenants] == ["team-z", "team-a"]
    tenants.write_text(f"- name: team-b\n  api_key_sha256: [{TENANT_DIGEST}]\n")  # a bare list
    assert [t.name for t in load_config(config).tenants] == ["team-z", "team-b"]
    tenants.write_text("- name: team-b\n  api_key_sha256: [not-a-digest]\n")
    with pytest.raises(ConfigError, match="tenants.1.api_key_sha256"):
        load_config(config)
    tenants.write_text("just text\n")
    with pytest.raises(ConfigError, match="write a `tenants:` list"):
        load_config(config)


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


def test_gpu_workers_hold_the_replicas_stages(tmp_path, monkeypatch):
    spec = _manifest()["spec"]
    cfg = _load_as_a_pod(_manifest(), tmp_path, monkeypatch,
                         {"serve-app-tenants": {"tenants.yaml": SECRET}})
    (model,) = cfg.models
    gpus = sum(int(g["replicas"]) * int(c["resources"]["limits"].get("nvidia.com/gpu", 0))
               for g in spec["rayClusterConfig"]["workerGroupSpecs"]
               for c in g["template"]["spec"]["containers"])
    assert model.pipeline_parallel_size == 2 and gpus >= model.world_size
    head = spec["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"  # engines run on the GPU pods only
