"""The LoRA sections of the schema: `lora:` and `adapters:`; every wrong one names its field."""

from pathlib import Path

import pytest

from serve_app.adapter_files import write_tiny_adapter
from serve_app.config import ConfigError, parse_config
from serve_app.models import write_model

DIGEST = "0" * 64


def _tenant(name, digit):
    return {"name": name, "api_key_sha256": [digit * 64]}


def _config(adapters, lora=None, tenants=("team-a", "team-b")):
    return {"models": [{"name": "base", "path": "/models/base",
                        "lora": lora if lora is not None else {"max_loras": 2,
                                                               "max_lora_rank": 8},
                        "adapters": adapters}],
            "tenants": [_tenant(t, str(i + 1)) for i, t in enumerate(tenants)]}


def _error(data, base_dir=None) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data, source="test.yaml", base_dir=base_dir)
    return str(info.value)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    tiny = write_model("tiny", root / "tiny")
    return write_tiny_adapter(root / "a", tiny, seed=1, rank=8)


def test_adapters_load_with_owners_and_public(adapter):
    cfg = parse_config(_config([
        {"name": "a-one", "path": str(adapter), "owners": ["team-a"]},
        {"name": "shared", "path": "org/hub-adapter", "owners": ["public"]}]))
    m = cfg.models[0]
    assert [a.name for a in m.adapters] == ["a-one", "shared"]
    assert m.adapters[1].public and not m.adapters[0].public
    assert cfg.adapter_owner("shared")[0] is m and cfg.adapter_owner("nope") is None


def test_relative_adapter_folder_resolves_like_a_model_path(adapter):
    base = adapter.parent
    cfg = parse_config(_config([{"name": "x", "path": "./a", "owners": ["public"]}]),
                       base_dir=base)
    assert cfg.models[0].adapters[0].path == str(adapter)


def test_adapters_need_lora():
    data = _config([{"name": "x", "path": "org/x", "owners": ["public"]}])
    data["models"][0].pop("lora")
    msg = _error(data)
    assert "models.0" in msg and "add `lora:" in msg


def test_adapter_name_may_not_be_a_model_name():
    msg = _error(_config([{"name": "base", "path": "org/x", "owners": ["public"]}]))
    assert "models.0.adapters.0.name" in msg and "a model's name" in msg


def test_adapter_names_are_unique_across_models():
    data = _config([{"name": "x", "path": "org/x", "owners": ["public"]}])
    data["models"].append({**data["models"][0], "name": "other",
                           "adapters": [{"name": "x", "path": "org/y", "owners": ["public"]}]})
    msg = _error(data)
    assert "models.1.adapters.0.name" in msg and "models.0.adapters.0" in msg


def test_adapter_names_are_unique_in_a_model():
    msg = _error(_config([{"name": "x", "path": "org/x", "owners": ["public"]},
                          {"name": "x", "path": "org/y", "owners": ["public"]}]))
    assert "models.0" in msg and "unique" in msg


def test_owners_are_configured_tenants():
    msg = _error(_config([{"name": "x", "path": "org/x", "owners": ["team-a"]},
                          {"name": "y", "path": "org/y", "owners": ["team-z"]}]))
    assert "models.0.adapters.1.owners" in msg and "team-z" in msg


def test_owners_may_not_be_empty():
    msg = _error(_config([{"name": "x", "path": "org/x", "owners": []}]))
    assert "models.0.adapters.0.owners" in msg


def test_open_endpoint_serves_public_adapters_only():
    data = _config([{"name": "x", "path": "org/x", "owners": ["team-a"]}], tenants=())
    assert "models.0.adapters.0.owners" in _error(data)
    parse_config(_config([{"name": "x", "path": "org/x", "owners": ["public"]}], tenants=()))


def test_a_local_folder_without_adapter_config_is_named(tmp_path, adapter):
    (tmp_path / "empty").mkdir()
    msg = _error(_config([{"name": "x", "path": str(adapter), "owners": ["public"]},
                          {"name": "y", "path": "./empty", "owners": ["public"]}]),
                 base_dir=tmp_path)
    assert "models.0.adapters.1.path" in msg and "adapter_config.json" in msg
    assert "adapters.0" not in msg


def test_a_missing_local_folder_is_named(tmp_path):
    msg = _error(_config([{"name": "y", "path": "./nowhere", "owners": ["public"]}]),
                 base_dir=tmp_path)
    assert "models.0.adapters.0.path" in msg and "not a folder" in msg


def test_rank_above_max_lora_rank_is_named(tmp_path):
    tiny = write_model("tiny", tmp_path / "tiny")
    big = write_tiny_adapter(tmp_path / "r16", tiny, seed=1, rank=16)
    msg = _error(_config([{"name": "y", "path": str(big), "owners": ["public"]}]))
    assert "models.0.adapters.0.path" in msg and "rank 16" in msg
    assert "models.0.lora.max_lora_rank (8)" in msg


@pytest.mark.parametrize("lora, field", [
    ({"max_lora_rank": 12}, "models.0.lora.max_lora_rank"),
    ({"max_loras": 0}, "models.0.lora.max_loras"),
    ({"max_loras": 4, "max_cpu_loras": 2}, "models.0.lora"),
    ({"max_lora": 4}, "models.0.lora.max_lora"),
])
def test_bad_lora_limits_are_named(lora, field):
    assert field in _error(_config([], lora=lora))


def test_engine_kwargs_may_not_set_lora():
    data = _config([])
    data["models"][0]["engine_kwargs"] = {"enable_lora": True}
    msg = _error(data)
    assert "models.0.engine_kwargs" in msg and "lora" in msg
