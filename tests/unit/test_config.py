"""The deployment schema: valid configs load, wrong ones fail naming the field and the fix."""

from pathlib import Path

import pytest

from serve_app.config import ConfigError, load_config, parse_config

REPO = Path(__file__).resolve().parents[2]


def _model(**kw):
    return {"name": "m", "path": "/models/m", **kw}


def _error(data) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data, source="test.yaml")
    return str(info.value)


@pytest.mark.parametrize("name", ["local-cpu.yaml", "gpu-1.yaml"])
def test_shipped_configs_load(name):
    cfg = load_config(REPO / "deployments" / name)
    assert cfg.models
    # Relative model paths under deployments/ resolve against the repository root.
    assert Path(cfg.models[0].path).is_absolute()
    assert Path(cfg.models[0].path).parent == REPO / "models"


def test_defaults():
    cfg = parse_config({"models": [_model()]})
    m = cfg.models[0]
    assert (m.tensor_parallel_size, m.pipeline_parallel_size, m.world_size) == (1, 1, 1)
    assert m.placement_strategy == "PACK"
    assert cfg.router.port == 8000
    assert cfg.model("m") is m and cfg.model("other") is None


def test_hub_id_path_kept_as_is():
    cfg = parse_config({"models": [_model(path="meta-llama/Llama-3.1-8B")]}, base_dir=REPO)
    assert cfg.models[0].path == "meta-llama/Llama-3.1-8B"


def test_unknown_field_is_named():
    msg = _error({"models": [_model(tensor_paralel_size=2)]})
    assert "models.0.tensor_paralel_size" in msg and "unknown field" in msg


def test_missing_models():
    assert "models" in _error({"router": {}})


def test_empty_models():
    assert "models" in _error({"models": []})


def test_not_a_mapping():
    assert "mapping" in _error(["models"])


def test_min_above_max_replicas():
    msg = _error({"models": [_model(autoscaling={"min_replicas": 3, "max_replicas": 2})]})
    assert "models.0.autoscaling" in msg and "raise max_replicas" in msg


def test_duplicate_model_names():
    msg = _error({"models": [_model(), _model()]})
    assert "unique" in msg and "'m'" in msg


@pytest.mark.parametrize("eager", [{"engine_kwargs": {"enforce_eager": True}},
                                   {"engine_kwargs": {"compilation_config": {"mode": 0}}},
                                   {"engine_env": {"VLLM_CPU_CI_ENV": "1"}}])
def test_pipeline_parallel_on_cpu_refused_in_eager_mode(eager):
    # vLLM's CPU worker skips the warm-up that allocates a later stage's receive buffer.
    msg = _error({"models": [_model(device="cpu", pipeline_parallel_size=2, **eager)]})
    assert "pipeline_parallel_size" in msg and "compilation_config" in msg


def test_pipeline_parallel_on_cpu_with_its_compile_warm_up():
    cfg = parse_config({"models": [_model(device="cpu", pipeline_parallel_size=2, engine_kwargs={
        "compilation_config": {"mode": 2, "backend": "eager"}})]}, source="test.yaml")
    assert cfg.models[0].executor_backend == "mp"


@pytest.mark.parametrize("key", ["model", "tensor_parallel_size", "max_model_len", "scheduler_cls"])
def test_engine_kwargs_may_not_override_schema(key):
    msg = _error({"models": [_model(engine_kwargs={key: 1})]})
    assert "models.0.engine_kwargs" in msg and key in msg


def test_zero_tensor_parallel():
    assert "models.0.tensor_parallel_size" in _error({"models": [_model(tensor_parallel_size=0)]})


def test_bad_placement_strategy():
    assert "placement_strategy" in _error({"models": [_model(placement_strategy="PAKC")]})


def test_bad_model_name():
    assert "models.0.name" in _error({"models": [_model(name="has space")]})


def test_bad_port():
    assert "router.port" in _error({"models": [_model()], "router": {"port": 70000}})


def test_yaml_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.yaml")


def test_open_endpoint_on_a_public_address_is_refused_unless_asked_for():
    from serve_app.config import ConfigError, parse_config

    models = [{"name": "m", "path": "/m"}]
    try:
        parse_config({"models": models, "router": {"host": "0.0.0.0"}})
    except ConfigError as err:
        assert "router.host" in str(err) and "tenants" in str(err)
    else:
        raise AssertionError("an open endpoint on 0.0.0.0 was accepted")
    parse_config({"models": models, "router": {"host": "0.0.0.0", "allow_open_endpoint": True}})
    parse_config({"models": models, "router": {"host": "127.0.0.1"}})


def test_stall_timeout_must_be_positive():
    msg = _error({"models": [_model()], "router": {"stream_stall_timeout_s": 0}})
    assert "router.stream_stall_timeout_s" in msg


def test_engine_stall_timeout_defaults_on_and_may_be_turned_off():
    from serve_app.config import DEFAULT_STALL_TIMEOUT_S

    assert parse_config({"models": [_model()]}).models[0].engine_stall_timeout_s == \
        DEFAULT_STALL_TIMEOUT_S
    off = parse_config({"models": [_model(engine_stall_timeout_s=None)]})
    assert off.models[0].engine_stall_timeout_s is None
    msg = _error({"models": [_model(engine_stall_timeout_s=0)]})
    assert "engine_stall_timeout_s" in msg


def test_scheduler_cls_in_engine_kwargs_names_the_models_own_field():
    """The engine's scheduler class is the schema's (priority_before_prefill picks it to match
    the engine's async scheduling); an engine_kwargs entry would silently disagree."""
    msg = _error({"models": [_model(engine_kwargs={"scheduler_cls": "x.Y"})]})
    assert "priority_before_prefill" in msg
