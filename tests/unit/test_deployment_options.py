"""Serve options and vLLM engine arguments derived from the schema."""

from serve_app.app import GRACEFUL_SHUTDOWN_S, llm_server_name, llm_server_options
from serve_app.config import ModelSettings
from serve_app.engine.vllm_adapter import engine_args_for


def _settings(**kw) -> ModelSettings:
    return ModelSettings(name="org/model-1", path="/m", **kw)


def test_fixed_replicas_without_autoscaling():
    opts = llm_server_options(_settings(autoscaling={"min_replicas": 2, "max_replicas": 2}))
    assert opts["num_replicas"] == 2 and "autoscaling_config" not in opts
    assert opts["name"] == llm_server_name("org/model-1") == "LLMServer-org_model-1"


def test_autoscaling_range():
    opts = llm_server_options(_settings(autoscaling={"min_replicas": 1, "max_replicas": 4}))
    assert opts["autoscaling_config"]["max_replicas"] == 4
    assert "num_replicas" not in opts


def test_long_streams_can_drain():
    assert llm_server_options(_settings())["graceful_shutdown_timeout_s"] == GRACEFUL_SHUTDOWN_S
    assert GRACEFUL_SHUTDOWN_S >= 300
    opts = llm_server_options(_settings(drain_timeout_s=1800))
    assert opts["graceful_shutdown_timeout_s"] == 1800


def test_engine_env_goes_to_runtime_env():
    opts = llm_server_options(_settings(engine_env={"VLLM_CPU_KVCACHE_SPACE": "1"}))
    assert opts["ray_actor_options"]["runtime_env"] == {
        "env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1"}
    }


def test_engine_args_pass_through_and_executor_choice():
    args = engine_args_for(_settings(engine_kwargs={"load_format": "dummy"}, max_model_len=4096))
    assert args["model"] == "/m" and args["served_model_name"] == "org/model-1"
    assert args["load_format"] == "dummy" and args["max_model_len"] == 4096
    assert "distributed_executor_backend" not in args
    gpu = engine_args_for(_settings(tensor_parallel_size=2, pipeline_parallel_size=2))
    assert gpu["distributed_executor_backend"] == "ray"
    assert gpu["tensor_parallel_size"] == 2 and gpu["pipeline_parallel_size"] == 2
    cpu = engine_args_for(_settings(device="cpu", tensor_parallel_size=2))
    assert cpu["distributed_executor_backend"] == "mp"


def test_router_reserves_no_cpu_and_takes_the_custom_resources_it_is_given():
    from serve_app.app import router_actor_options
    from serve_app.config import AppConfig, RouterSettings

    plain = AppConfig(models=[_settings()])
    assert router_actor_options(plain) == {"num_cpus": 0}
    pinned = plain.model_copy(update={"router": RouterSettings(resources={"head": 0.01})})
    assert router_actor_options(pinned) == {"num_cpus": 0, "resources": {"head": 0.01}}


def test_router_resources_refuse_cpu_and_zero_naming_the_field():
    import pytest
    from pydantic import ValidationError

    from serve_app.config import RouterSettings

    with pytest.raises(ValidationError, match=r"router.resources: CPU is not a custom"):
        RouterSettings(resources={"CPU": 1})
    with pytest.raises(ValidationError, match=r"router.resources.head: 0.0 must be > 0"):
        RouterSettings(resources={"head": 0})
